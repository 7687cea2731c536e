"""Time one training step under DDP and FSDP2 beside two controls, and measure the rates a prediction of it needs.

    torchrun --standalone --nproc-per-node 2 helpers/workers/scale_step_time.py --rounds 7

The model is a stack of `--layers` Linear(width, width) layers (seed 0), each rank with its own `--batch` rows.
Every timing follows the timing protocol (helpers/kit/timing.py): the settings compared take turns, in a shuffled
order that is the same on every rank, after warm-up, for `--rounds` rounds, and every turn starts after a barrier.
Each rank hands back its own rounds; the notebook merges them (helpers.kit.timing.across_ranks: a round lasts as
long as its slowest rank). Measured, each as one set of settings taking turns:
- an all_reduce of each size from 4 KB to 16 MB: the data lesson 01's latency-bandwidth fit is made from;
- one forward matmul of the model's shape (the FLOP rate);
- the optimizer step alone (Adam, no communication) of three set-ups, gradients in place: "local" (plain tensors,
  the whole model, as DDP's), "fsdp_alone" (DTensors holding the whole model) and "fsdp" (DTensors holding half of
  each tensor's rows);
- the training step (forward, backward, optimizer step) of "local" (the plain model, no communication at all: a
  control), "ddp", "fsdp" (`fully_shard` on every layer, then the model) and "fsdp_alone" (FSDP2 over a group of
  one rank: all of its own work, no peer: a control).
CPU and gloo only, also where GPUs exist: it times this machine's cores. Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns

SIZES = [4096 * 4**k for k in range(7)]  # bytes, 4 KB .. 16 MB


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def set_up(mode: str, width: int, layers: int, alone: dist.ProcessGroup) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = build(width, layers)
    if mode.startswith("fsdp"):
        mesh = DeviceMesh.from_group(alone, "cpu") if mode == "fsdp_alone" else None
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "ddp":
        model = DDP(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)


class Turns:
    """Before every timed turn: a barrier (every rank starts the turn together), and the progress bar moves."""

    def __init__(self, total: int) -> None:
        self.done, self.total = 0, total

    def __call__(self) -> None:
        dist.barrier()
        self.done += 1
        progress(self.done, self.total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    # 3 layers, not more: each rank keeps four set-ups alive (model, gradients, Adam state, buckets)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rank, world_size, _ = init_distributed("gloo")  # this machine's CPU: the prediction is for it
    settings = len(SIZES) + 1 + 3 + 4  # all-reduce sizes; matmul; three optimizer steps; four training steps
    turns = dict(rounds=args.rounds, warmup=args.warmup, between=Turns((args.rounds + args.warmup) * settings))
    timings = {}

    buffers = {size: torch.ones(size // 4) for size in SIZES}
    timings.update(take_turns({f"all_reduce {size}": lambda t=t: dist.all_reduce(t) for size, t in buffers.items()},
                              **turns))

    # one group per rank, made by every rank in the same order: FSDP2 over a group of one has no peer to talk to
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    inputs = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))
    setups = {mode: set_up(mode, args.width, args.layers, alone) for mode in ("local", "ddp", "fsdp", "fsdp_alone")}
    for model, optimizer in setups.values():  # gradients in place and Adam's state made: step() is one update
        model(inputs).square().mean().backward()
        optimizer.step()
    weight, activations = torch.randn(args.width, args.width), torch.randn(args.batch, args.width)
    timings.update(take_turns({"matmul": lambda: activations @ weight,
                               **{f"adam {mode}": setups[mode][1].step for mode in ("local", "fsdp", "fsdp_alone")}},
                              repeat=5, **turns))
    timings.update(take_turns({f"step {mode}": lambda m=model, o=optimizer: training_step(m, o, inputs)
                               for mode, (model, optimizer) in setups.items()}, **turns))
    result(timings={name: timing.as_dict() for name, timing in timings.items()}, sizes=SIZES,
           n_params=sum(p.numel() for p in setups["local"][0].parameters()), tensors=2 * args.layers,
           width=args.width, layers=args.layers, batch=args.batch, world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
