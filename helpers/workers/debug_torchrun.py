"""A two-rank job whose rank 1 fails at start, to read what torchrun itself prints. It imports no torch.

    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_torchrun.py

torchrun's summary does not depend on what the script does, and a fresh interpreter that imports torch costs
about 300 MiB here, more than a 1.5 GiB lesson can spare twice. Rank 1's data shard is missing (the planted
bug); rank 0 stands in for a rank still training with a sleep (simulated work), until torchrun stops it.
"""
import os
import time


def main() -> None:
    rank = int(os.environ["RANK"])  # set by torchrun
    if rank == 1:
        raise FileNotFoundError("data/shard-1.bin: rank 1's data shard is missing")
    time.sleep(60)  # simulated work: torchrun sends SIGTERM once rank 1 has failed


if __name__ == "__main__":
    main()
