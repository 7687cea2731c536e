"""Time all_reduce over message sizes (1 KB .. 64 MB by default), and 1 MB sent whole against 1 MB in 4 KB pieces.

    torchrun --standalone --nproc-per-node 2 helpers/workers/collectives_bandwidth.py --repeats 10 --rounds 5

The timing protocol of helpers/kit/timing.py: every setting takes turns with the others inside this one launch,
in a shuffled order each round (the same order on every rank), after one warm-up round; a barrier starts every
turn on all ranks together. A message size's turn is `repeats` calls back to back under one timer, as nccl-tests'
all_reduce_perf times them (no barrier between the calls), divided by `repeats`. The setting "1 MB as 256 x 4 KB"
all-reduces the same 1 MB in 256 messages of 4 KB, one after the other: what sending every gradient tensor on its
own costs, against one bucket. Every rank hands back its own wall and CPU seconds per round
(result(timings=...)); helpers.kit.timing.across_ranks merges them (a round is as slow as its slowest rank).
Works with any number of processes, on CPU (gloo) or GPUs (nccl, with a device synchronize at the end of a turn).
"""
import argparse

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns

PIECE_BYTES = 4096  # the small messages of the "1 MB as 256 x 4 KB" setting


def label(size: int) -> str:
    return f"{size // 1024} KB" if size < 2**20 else f"{size // 2**20} MB"


def all_reduce_loop(tensor: torch.Tensor, calls: int):
    """A turn: `calls` all_reduces of `tensor` back to back (and, on a GPU, wait until they finished)."""
    def turn() -> None:
        for _ in range(calls):
            dist.all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()  # GPU collectives return before they finish
    return turn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--factor", type=int, default=4, help="each size is this many times the last")
    parser.add_argument("--repeats", type=int, default=10, help="calls back to back in one turn of a message size")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (at least 5), after one warm-up round")
    parser.add_argument("--pieces", type=int, default=256, help="the 4 KB messages that make up the whole message")
    args = parser.parse_args()
    _, world_size, device = init_distributed()

    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor
    settings = {label(size): all_reduce_loop(torch.zeros(size // 4, device=device), args.repeats) for size in sizes}
    whole = args.pieces * PIECE_BYTES
    pieces_name = f"{label(whole)} as {args.pieces} x {label(PIECE_BYTES)}"
    settings[pieces_name] = all_reduce_loop(torch.zeros(PIECE_BYTES // 4, device=device), args.pieces)

    turns, total = [0], (1 + args.rounds) * len(settings)

    def start_turn() -> None:  # every rank starts a turn together, and the progress bar moves
        dist.barrier()
        turns[0] += 1
        progress(turns[0], total)

    timings = take_turns(settings, rounds=args.rounds, warmup=1, between=start_turn)
    for name, timing in timings.items():  # seconds per call for the sizes; the pieces' turn is one whole message
        calls = 1 if name == pieces_name else args.repeats
        timing.wall = [seconds / calls for seconds in timing.wall]
        timing.cpu = [seconds / calls for seconds in timing.cpu]
    result(sizes=sizes, names=[label(size) for size in sizes], pieces=pieces_name, whole_bytes=whole,
           timings={name: timing.as_dict() for name, timing in timings.items()}, world_size=world_size,
           backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
