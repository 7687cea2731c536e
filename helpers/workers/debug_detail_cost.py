"""What TORCH_DISTRIBUTED_DEBUG=DETAIL costs: the same all-reduces on a plain group and on a DETAIL group, taking turns.

    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_detail_cost.py

torch wraps a process group in its checker (ProcessGroupWrapper) when the group is created while the debug level is
DETAIL. So one launch can hold both: a plain gloo group, and one created after dist.set_debug_level(DETAIL). The two
take turns (helpers/kit/timing.py: a shuffled order each round, the same on every rank, after a warm-up), each turn
`--calls` times the step of debug_collectives.py: an all-reduce of 8 floats and one of a 1-number sample count.
"""
import argparse

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.timing import take_turns


def one_step(group: dist.ProcessGroup) -> None:
    dist.all_reduce(torch.ones(8), group=group)
    dist.all_reduce(torch.tensor([16.0], dtype=torch.float64), group=group)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20, help="steps per turn")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    dist.set_debug_level(dist.DebugLevel.OFF)  # whatever the environment says: the plain group is plain
    init_distributed("gloo")
    plain = dist.new_group(backend="gloo")
    dist.set_debug_level(dist.DebugLevel.DETAIL)  # groups created from here on are wrapped in the checker
    checked = dist.new_group(backend="gloo")
    dist.set_debug_level(dist.DebugLevel.OFF)
    timings = take_turns({"plain": lambda: one_step(plain), "DETAIL": lambda: one_step(checked)},
                         rounds=args.rounds, warmup=1, repeat=args.calls, between=dist.barrier)
    result(timings={name: timing.as_dict() for name, timing in timings.items()},
           wrapped=type(checked._get_backend(torch.device("cpu"))).__name__,
           plain=type(plain._get_backend(torch.device("cpu"))).__name__)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
