"""Is the fabric healthy? Run this before blaming the code: every rank must reach every other, fast enough.

    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_network_check.py
    # on a cluster, the same command line as the job (its nodes, its rendezvous), e.g. under Slurm:
    srun --nodes 2 --ntasks-per-node 1 torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \
        --rdzv-endpoint $HEAD_NODE:29500 --rdzv-id $SLURM_JOB_ID helpers/workers/debug_network_check.py

Every rank says where it runs (host, process, device), then two checks with a short timeout, so that a broken link
fails in seconds instead of hanging: an all-reduce of small numbers whose sum is known (every rank must get it), and
a timed all-reduce of --megabytes (the bus bandwidth per rank, busbw = bytes x 2(n-1)/n / seconds, as nccl-tests
report it). The all-reduce ends for every rank together, so within one run every rank reports about the same
bandwidth: a slow link or card slows them all, and one run cannot say where it is. To find it, run the check on
pairs (or small subsets) of nodes, or of GPUs with CUDA_VISIBLE_DEVICES, and compare the runs: the slow or hanging
pair holds it. With NCCL, add NCCL_DEBUG=INFO to see the network it chose (NET/IB or NET/Socket, and the
interface). Works with one process.
"""
import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds before a collective fails")
    args = parser.parse_args()
    rank, world_size, device = init_distributed(timeout=timedelta(seconds=args.timeout))

    where = [None] * world_size
    dist.all_gather_object(where, f"{socket.gethostname()} pid {os.getpid()} {device}")
    known = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(known)  # every rank must get 1 + 2 + ... + world_size
    expected = world_size * (world_size + 1) / 2

    payload = torch.ones(int(args.megabytes * 2**20 / 4), device=device)
    seconds = []
    for _ in range(args.rounds + 1):  # the first round warms up the connections
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dist.all_reduce(payload)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds[1:])
    busbw = payload.numel() * 4 * 2 * (world_size - 1) / world_size / median if world_size > 1 else 0.0
    ok = known.item() == expected
    print(f"rank {rank} ({device}): sum {'OK' if ok else f'WRONG ({known.item()} != {expected})'}, "
          f"all-reduce of {args.megabytes:g} MB in {median * 1e3:.1f} ms (median of {args.rounds}), "
          f"busbw {busbw / 1e9:.2f} GB/s", flush=True)
    result(where=where, sum_ok=ok, seconds=seconds[1:], busbw=busbw, backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
