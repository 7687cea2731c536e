"""A worker that breaks on purpose: rank 1 divides by zero at step 3 while rank 0 waits for it.

    torchrun --standalone --nproc-per-node 2 helpers/workers/broken_demo.py

Lesson 00 launches it to show what a failure looks like: one error naming the rank and its
traceback, and no process left behind (rank 0, blocked in all_reduce, is stopped, or fails on the closed connection).
"""
import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed


def scale(step: int, rank: int) -> float:
    return 1.0 / (3 - step) if rank == 1 else 1.0


def main() -> None:
    rank, _, device = init_distributed()
    for step in range(5):
        total = torch.tensor([scale(step, rank)], device=device)
        dist.all_reduce(total)
        print(f"step {step}: sum {total.item():.3f}")


if __name__ == "__main__":
    main()
