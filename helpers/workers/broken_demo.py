"""A worker that breaks on purpose: rank 1 divides by zero at step 3 while rank 0 waits for it.

    torchrun --standalone --nproc-per-node 2 helpers/workers/broken_demo.py
    torchrun --standalone --nproc-per-node 2 helpers/workers/broken_demo.py --no-record   # main() without @record

Lesson 00 runs it under a bare torchrun (to show torchrun's own failure report, with and without @record) and
under helpers.launch (one error naming the rank that failed first, and no process left behind).
"""
import sys

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.kit.distributed import init_distributed


def scale(step: int, rank: int) -> float:
    return 1.0 / (3 - step) if rank == 1 else 1.0


def main() -> None:
    rank, _, device = init_distributed()
    for step in range(5):
        total = torch.tensor([scale(step, rank)], device=device)
        dist.all_reduce(total)
        print(f"step {step}: sum {total.item():.3f}", flush=True)


if __name__ == "__main__":
    # record(main) is what `@record` above `def main` does: if main raises, it writes the traceback to the error
    # file torchrun reads for its report; without it, torchrun's report has only the exit code
    entry = main if "--no-record" in sys.argv[1:] else record(main)
    entry()
