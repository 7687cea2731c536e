"""The article's download=True on every rank, as a race you can see; and the fix (rank 0, then barrier).

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_download_race.py            # the race
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_download_race.py --fix      # rank 0 + barrier

Ours, a staged model of torchvision 0.29's MNIST(train=True, download=True), with a slow fake network:
- MNIST.download() returns at once only when _check_exists() finds all four *extracted* files
  (torchvision/datasets/mnist.py:168-172, 177-178);
- otherwise it takes the four archives in order, train-images, train-labels, t10k-images,
  t10k-labels (mnist.py:42-47, 182-188): download_url skips an archive that passes its md5 check and
  re-downloads one that does not, a half-written one included, opening it with "wb"
  (torchvision/datasets/utils.py:111-131, 29); then the archive is extracted, again with "wb",
  every time (utils.py:317);
- then MNIST reads the two train files only (mnist.py:122-128).
So a rank that arrives while another is downloading does not skip: it downloads and extracts too,
into the same files. Here rank 1 is staged to arrive while rank 0 is writing the first archive (a
real rank arrives whenever it does). What the two writers leave behind depends on the timing: the
run reports what each rank wrote, whether an archive failed its check (torchvision raises
"File not found or corrupted." and tries the next mirror, utils.py:136-137, mnist.py:189-192), and
whether the train files each rank read were complete.
"""
import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result

FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")
CHUNKS, CHUNK_BYTES, NETWORK_SECONDS = 4, 4096, 0.05  # each archive: 16 KiB, written over about 0.2 s
CONTENT = b"".join(bytes([chunk + 1]) * CHUNK_BYTES for chunk in range(CHUNKS))  # what a complete file holds


def intact(path: Path) -> bool:
    """Our stand-in for the md5 check: the file is there and holds exactly the right bytes."""
    return path.exists() and path.read_bytes() == CONTENT


def download(raw: Path, log: list[str]) -> None:
    """Our model of MNIST.download(), step for step (see the docstring for torchvision's lines)."""
    if all((raw / name).exists() for name in FILES):  # _check_exists(): all four extracted files
        log.append("found all 4 extracted files, skipped the download")
        return
    for name in FILES:
        archive = raw / f"{name}.gz"
        if not intact(archive):  # download_url: fetch unless the archive passes its check
            with open(archive, "wb") as file:  # _urlretrieve opens with "wb": truncates a partner's file
                for chunk in range(CHUNKS):
                    file.write(CONTENT[chunk * CHUNK_BYTES:(chunk + 1) * CHUNK_BYTES])
                    file.flush()
                    time.sleep(NETWORK_SECONDS)  # the network
            if not intact(archive):  # the check after the download
                log.append(f"fetched {archive.name}: it FAILED its check")
                continue  # torchvision would raise and try the next mirror
            log.append(f"fetched {archive.name}")
        with open(raw / name, "wb") as file:  # _decompress: "wb", every time
            file.write(archive.read_bytes())
        log.append(f"extracted {name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="rank 0 downloads, the others wait at a barrier")
    args = parser.parse_args()
    rank, _, _ = init_distributed()
    folder = [tempfile.mkdtemp(prefix="ddp_download_") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one shared folder, like the article's './data'
    raw = Path(folder[0])
    dist.barrier()  # start together, as mp.spawn's children do
    log: list[str] = []
    if args.fix:
        if rank == 0:
            download(raw, log)
        else:
            log.append("waited for rank 0")
        dist.barrier()  # nobody reads before rank 0 has finished writing
    else:
        if rank > 0:  # staged: rank 1 arrives while rank 0 writes the first archive
            deadline = time.monotonic() + 10
            while not (raw / f"{FILES[0]}.gz").exists() and time.monotonic() < deadline:
                time.sleep(0.005)
        download(raw, log)
    read = {name: (raw / name).read_bytes() if (raw / name).exists() else b"" for name in FILES[:2]}  # _load_data
    result(log=log, wrote=any(line.startswith(("fetched", "extracted")) for line in log),
           skipped=any("skipped" in line for line in log), failed_check=any("FAILED" in line for line in log),
           bytes_read={name: len(data) for name, data in read.items()},
           complete=all(data == CONTENT for data in read.values()))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(raw)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
