"""Time all_reduce over message sizes (1 KB .. 64 MB by default): the cost of communication.

    torchrun --standalone --nproc-per-node 2 helpers/workers/collectives_bandwidth.py --repeats 5

For each size: one untimed warm-up (buffers, connections), then `repeats` timed calls, each started
together after a barrier. A call lasts as long as its slowest rank, so we keep the maximum over ranks
(an all_reduce with MAX) and, over repeats, the median. Rank 0 hands back sizes and seconds.
Works with any number of processes, on CPU (gloo) or GPUs (nccl, timed with a device synchronize).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

from helpers.distributed import init_distributed
from helpers.reporting import progress, report, result


def time_all_reduce(tensor: torch.Tensor, repeats: int) -> float:
    """Median over repeats of the slowest rank's time for one all_reduce of `tensor`."""
    dist.all_reduce(tensor)  # warm-up
    samples = []
    for _ in range(repeats):
        dist.barrier()
        if tensor.is_cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        if tensor.is_cuda:
            torch.cuda.synchronize()  # GPU collectives return before they finish
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64, device=tensor.device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(elapsed.item())
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-bytes", type=int, default=1024)
    parser.add_argument("--max-bytes", type=int, default=64 * 1024 * 1024)
    parser.add_argument("--factor", type=int, default=4, help="each size is this many times the last")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rank, world_size, device = init_distributed()

    sizes = []
    size = args.min_bytes
    while size <= args.max_bytes:
        sizes.append(size)
        size *= args.factor
    seconds = []
    for index, size in enumerate(sizes):
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)  # 4 bytes per float32
        seconds.append(time_all_reduce(tensor, args.repeats))
        if rank == 0:
            print(f"{size:>12,} bytes: {seconds[-1] * 1e3:8.3f} ms")
        report(step=index, bytes=size, seconds=seconds[-1])
        progress(index + 1, total=len(sizes))
    if rank == 0:
        result(sizes=sizes, seconds=seconds, world_size=world_size,
               backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
