"""What torchrun itself prints when a rank fails, without and with @record (lesson 02).

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_failure_report.py            # no traceback in it
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_failure_report.py --record   # the traceback in it

Rank 1 raises a ValueError at its first step; rank 0 then waits in an all_reduce that rank 1 never joins. torchrun's
agent sees a worker exit with an error, stops the others and raises ChildFailedError, whose report lists every
failure and names a "Root Cause (first observed failure)". A worker's traceback reaches that report only through an
error file, which `torch.distributed.elastic.multiprocessing.errors.record` writes when the decorated function raises.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    total = torch.ones(1)
    for step in range(5):
        # At step 0, before any collective of rank 1's own. Raised just after one, the rank now and then died of
        # SIGABRT on its way out instead: gloo's thread let go of that all_reduce's tensor after Python had begun
        # to shut down (needing the GIL then aborts the process), and the report gave the signal as its exit.
        if rank == 1 and step == 0:
            raise ValueError(f"rank {rank} found a bad batch at step {step}")
        dist.all_reduce(total)
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="decorate main with @record, as torch advises")
    if parser.parse_args().record:
        main = record(main)  # the same as writing @record above `def main`
    main()
