"""The bytes each rank really sends for one collective on gloo, read from the operating system's count of writes.

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_wire.py

gloo moves data over TCP sockets, so what a rank sends is part of what its process writes: `wchar` in
/proc/self/io (Linux; the count covers every thread of the process, gloo's own threads included). For each
collective the ZeRO stages use, on a tensor of --mib MiB, each rank reads wchar before and after (--rounds times) and
hands back the smallest difference as a fraction of the tensor's bytes: all_reduce, reduce_scatter_single,
all_gather_single, and one broadcast per owner of a shard (how ZeroRedundancyOptimizer shares its updates).
This worker always uses gloo on CPU tensors: it measures gloo's implementation. NCCL's traffic goes through GPU
memory, NVLink or RDMA, where a count of the process's writes cannot see it. Without /proc/self/io it reports None.
Works with one process (which sends nothing).
"""
import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result

IO = Path("/proc/self/io")


def written() -> int:
    return int(next(line.split()[1] for line in IO.read_text().splitlines() if line.startswith("wchar:")))


def fraction(collective, tensor_bytes: int, rounds: int) -> float:
    """The least bytes this rank wrote in one call of `collective`, over `rounds` calls, per byte of the tensor."""
    seen = []
    for _ in range(rounds):
        dist.barrier()
        before = written()
        collective()
        seen.append(written() - before)
    return min(seen) / tensor_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    _, world_size, _ = init_distributed("gloo")  # gloo on purpose, also on a machine with GPUs: it measures gloo
    values = int(args.mib * 2**20) // 4 // world_size * world_size
    full, shard = torch.ones(values), torch.ones(values // world_size)
    operations = {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_single": lambda: dist.reduce_scatter_single(shard, full),
        "all_gather_single": lambda: dist.all_gather_single(full, shard),
        "broadcast, one per owner": lambda: [dist.broadcast(part, src=owner)
                                             for owner, part in enumerate(full.chunk(world_size))],
    }
    measured = ({name: fraction(call, 4 * values, args.rounds) for name, call in operations.items()}
                if IO.exists() and os.access(IO, os.R_OK) else None)
    result(world_size=world_size, tensor_bytes=4 * values, sent=measured)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
