"""Two ranks that both start with a blocking send to each other: neither reaches its recv.

    torchrun --standalone --nproc-per-node 2 helpers/workers/collectives_deadlock.py --timeout-seconds 2

gloo's send returns only once the peer has posted the matching recv, even for a few bytes, so each rank
waits for the other until the process group's timeout (here short) ends it. isend/irecv avoid this.
Each rank hands back the first line of the error it got, or "completed" if the exchange went through.
gloo only: with nccl, dist.send just queues the transfer on a CUDA stream and returns, so the CPU side would
report "completed" whatever the GPUs then do; the script refuses to run there.
"""
import argparse
import datetime

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout-seconds", type=float, default=2.0)
    parser.add_argument("--numel", type=int, default=4)
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    if world_size < 2:
        raise SystemExit("a deadlock needs two ranks: run it with --nproc-per-node 2")
    if dist.get_backend() != "gloo":
        raise SystemExit(f"this demonstrates gloo's blocking send; with {dist.get_backend()} send returns once "
                         "the transfer is queued, so the outcome here would say nothing: run it on CPUs (gloo)")
    # a group of everyone with a short timeout, so that the wait below ends in seconds, not minutes
    impatient = dist.new_group(timeout=datetime.timedelta(seconds=args.timeout_seconds))
    peer = (rank + 1) % world_size
    mine, theirs = torch.full((args.numel,), float(rank), device=device), torch.empty(args.numel, device=device)
    try:
        dist.send(mine, dst=peer, group=impatient)  # both ranks block here: each waits for the other's recv
        dist.recv(theirs, src=peer, group=impatient)
        outcome = "completed"
    except RuntimeError as error:
        outcome = str(error).splitlines()[0]
    result(outcome=outcome, backend=dist.get_backend())
    # no destroy_process_group: the group is broken after a timeout, and exiting is all that is left


if __name__ == "__main__":
    main()
