"""torchvision's own MNIST(download=True) on every rank, offline: does a rank that arrives mid-download skip?

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_download_torchvision.py

torchvision's code runs unchanged except for two seams we replace, because this machine has no
network: download_url asks _is_remote_location_available() and, when it says True, calls
_download_file_from_remote_location(fpath, url) (torchvision/datasets/utils.py:114-115). Ours writes
a small valid MNIST archive (4 images) slowly, in chunks, with "wb", and records each call.
MNIST.resources is set to those archives' md5s so torchvision's checks pass on intact files.
Rank 1 is staged to arrive while rank 0 writes the first archive. Everything else, _check_exists,
download_and_extract_archive, the md5 checks, _load_data, is torchvision's.
"""
import gzip
import hashlib
import shutil
import struct
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torchvision.datasets.utils as tv_utils
from torchvision import datasets

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result

SAMPLES, CHUNKS, NETWORK_SECONDS = 4, 4, 0.05


def archives() -> dict[str, bytes]:
    """Valid gzip'd IDX files (the format torchvision's read_sn3_pascalvincent_tensor reads), 4 samples each."""
    images = struct.pack(">iiii", 0x803, SAMPLES, 28, 28) + bytes(range(256)) * (SAMPLES * 28 * 28 // 256) \
        + bytes(SAMPLES * 28 * 28 % 256)
    labels = struct.pack(">ii", 0x801, SAMPLES) + bytes(range(SAMPLES))
    raw = {"train-images-idx3-ubyte": images, "train-labels-idx1-ubyte": labels,
           "t10k-images-idx3-ubyte": images, "t10k-labels-idx1-ubyte": labels}
    return {f"{name}.gz": gzip.compress(data, mtime=0) for name, data in raw.items()}


def main() -> None:
    rank, _, _ = init_distributed()
    served = archives()
    datasets.MNIST.resources = [(name, hashlib.md5(data).hexdigest()) for name, data in served.items()]
    fetched: list[str] = []

    def fake_fetch(fpath: str, url: str) -> None:  # the slow network, writing with "wb" as _urlretrieve does
        data = served[Path(fpath).name]
        step = -(-len(data) // CHUNKS)
        with open(fpath, "wb") as file:
            for start in range(0, len(data), step):
                file.write(data[start:start + step])
                file.flush()
                time.sleep(NETWORK_SECONDS)
        fetched.append(Path(fpath).name)

    tv_utils._is_remote_location_available = lambda: True
    tv_utils._download_file_from_remote_location = fake_fetch

    folder = [tempfile.mkdtemp(prefix="ddp_tv_download_") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one shared folder, like the article's './data'
    root = Path(folder[0])
    dist.barrier()
    if rank > 0:  # staged: arrive while rank 0 writes the first archive
        deadline = time.monotonic() + 10
        while not (root / "MNIST" / "raw" / "train-images-idx3-ubyte.gz").exists() and time.monotonic() < deadline:
            time.sleep(0.005)
    try:
        samples, error = len(datasets.MNIST(str(root), train=True, download=True)), ""
    except Exception as exc:  # a clash of two writers may fail torchvision's check: report it, do not hide it
        samples, error = 0, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    dist.barrier()
    first = list(fetched)
    if rank == 0 and not error:  # a second call, after the files are there: torchvision should fetch nothing
        datasets.MNIST(str(root), train=True, download=True)
    result(fetched=first, samples=samples, error=error, fetched_again=fetched[len(first):])
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
