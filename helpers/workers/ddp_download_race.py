"""The article's download=True on every rank, as a race you can see; and the fix (rank 0, then barrier).

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_download_race.py            # the race
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_download_race.py --fix      # rank 0 + barrier

torchvision's MNIST(download=True) calls MNIST.download(), which returns at once if _check_exists()
finds the files, and _check_exists() only asks whether they exist (check_integrity without an md5).
`fetch` below does the same with a slow fake download (no network needed): write a file in chunks
unless it exists. Rank 0 calls it at once; rank 1 is staged to call it as soon as rank 0's file appears,
that is, while it is still being written (a real rank 1 might come earlier, and download too, or after
the download ended, and read a complete file: the race decides, which is the bug).
"""
import argparse
import os
import tempfile
import time
from pathlib import Path

import torch.distributed as dist

from helpers.distributed import init_distributed
from helpers.reporting import result

CHUNKS, CHUNK = 8, b"x" * 4096  # the whole "data set": 32 KiB, written over about 0.4 s


def fetch(path: Path) -> str:
    """Like MNIST.download(): return if the file is there, else download (slowly) and write it."""
    if path.exists():  # what _check_exists() asks: present, not complete
        return "found the file, skipped the download"
    with open(path, "wb") as file:
        for _ in range(CHUNKS):
            file.write(CHUNK)
            file.flush()
            time.sleep(0.05)  # the network
    return "downloaded"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fix", action="store_true", help="rank 0 downloads, the others wait at a barrier")
    args = parser.parse_args()
    rank, _, _ = init_distributed()
    folder = [tempfile.mkdtemp(prefix="ddp_download_") if rank == 0 else None]
    dist.broadcast_object_list(folder, src=0)  # one shared folder, like the article's './data'
    path = Path(folder[0]) / "train-images-idx3-ubyte"
    dist.barrier()  # start together, as mp.spawn's children do
    if args.fix:
        action = fetch(path) if rank == 0 else "waited for rank 0"
        dist.barrier()  # nobody reads before rank 0 has finished writing
    else:
        if rank > 0:  # staged: rank 1 arrives while rank 0 is writing (a real rank arrives whenever it does)
            deadline = time.monotonic() + 10
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        action = fetch(path)
    size = path.stat().st_size  # what this rank would now read as its data set
    result(action=action, bytes_read=size, complete=size == CHUNKS * len(CHUNK))
    dist.barrier()
    if rank == 0:
        os.remove(path)
        os.rmdir(path.parent)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
