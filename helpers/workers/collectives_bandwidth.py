"""Time all_reduce over message sizes (1 KB .. 64 MB by default): the cost of communication.

    torchrun --standalone --nproc-per-node 2 helpers/workers/collectives_bandwidth.py --repeats 10

For each size, as nccl-tests' all_reduce_perf does: untimed warm-up calls (buffers, connections), one barrier,
then `repeats` calls back to back under one timer, with no barrier between them; the time per call is the
elapsed time divided by `repeats`. Ranks finish at slightly different times, so we keep the slowest rank's
(an all_reduce with MAX). The barrier's exit skew lands once in the whole loop, not once per call. On a shared
machine one burst of load can spoil a loop, so the worker times every size `--loops` times (3), sweeping all
sizes once per loop (interleaved, so one burst does not hit all three timings of a size), and keeps the median.
Rank 0 hands back sizes, the median seconds, and the fastest and slowest of the loops per size. Works with any
number of processes, on CPU (gloo) or GPUs (nccl, timed with a device synchronize before and after the loop).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, report, result


def time_all_reduce(tensor: torch.Tensor, repeats: int) -> float:
    """Seconds per all_reduce of `tensor`: `repeats` calls back to back under one timer, the slowest rank's
    time per call."""
    dist.barrier()  # once per loop, not per call: every rank starts the loop together
    if tensor.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        dist.all_reduce(tensor)
    if tensor.is_cuda:
        torch.cuda.synchronize()  # GPU collectives return before they finish
    elapsed = torch.tensor([(time.perf_counter() - started) / repeats], dtype=torch.float64, device=tensor.device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--factor", type=int, default=4, help="each size is this many times the last")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per loop, back to back")
    parser.add_argument("--loops", type=int, default=3, help="timed loops over all sizes; each size's median is kept")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per size before the first loop")
    args = parser.parse_args()
    rank, world_size, device = init_distributed()

    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor
    # untimed warm-up of every size (buffers, connections; the very first calls of a run are slow)
    for size in sizes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)  # 4 bytes per float32
        for _ in range(args.warmup):
            dist.all_reduce(tensor)
    # the loops run over all sizes in turn (1 KB .. 64 MB, then again), not 3 loops of one size back to back:
    # a burst of load from other programs then lands in one loop of several sizes, and the median drops it
    timings: list[list[float]] = [[] for _ in sizes]
    for loop in range(args.loops):
        for index, size in enumerate(sizes):
            tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
            dist.all_reduce(tensor)  # untimed: the fresh tensor's first call
            timings[index].append(time_all_reduce(tensor, args.repeats))
            report(loop=loop, bytes=size, seconds=timings[index][-1])
            progress(loop * len(sizes) + index + 1, total=args.loops * len(sizes))
    seconds = [statistics.median(times) for times in timings]
    if rank == 0:
        result(sizes=sizes, seconds=seconds, fastest=[min(t) for t in timings], slowest=[max(t) for t in timings],
               world_size=world_size,
               backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
