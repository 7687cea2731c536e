"""Time one training step under DDP, ZeRO-1 and FSDP2, and measure what a prediction of it needs.

    torchrun --standalone --nproc-per-node 2 helpers/workers/scale_step_time.py --steps 8

The model is a stack of `--layers` Linear(width, width) layers (seed 0), each rank with its own `--batch` rows.
Measured, in this order, each as the slowest rank's time (an all_reduce with MAX) and the median over repeats:
- an all_reduce sweep (4 KB to 16 MB), for the latency and bandwidth fit of lesson 01;
- the FLOP rate of one forward matmul of the model's shape, and the time of one Adam step on the whole model and
  on half of it, without any communication;
- the step time (forward, backward, optimizer step) of DDP, ZeRO-1 (DDP with ZeroRedundancyOptimizer) and FSDP2
  (`fully_shard` on every layer, then the model), after `--warmup` untimed steps, one step of each mode per round
  for `--steps` rounds (median per mode); and two controls: the plain model
  with no communication at all ("local"), and FSDP2 over a group of one rank ("fsdp_alone": all its own work,
  no peer), both run by every rank at the same time as in the real modes.
CPU and gloo only, also where GPUs exist: it times this machine's cores. Works with one process.
"""
import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, result


def slowest_median(action: Callable[[], object], repeats: int) -> float:
    """Median over repeats of the slowest rank's seconds for `action` (every rank starts after a barrier)."""
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        action()
        elapsed = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        samples.append(elapsed.item())
    return statistics.median(samples)


def build(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def training_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor) -> None:
    model(inputs).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def adam_seconds(model: nn.Module, fraction: float, repeats: int) -> float:
    """One Adam step on the first `fraction` of the model's parameter tensors, gradients set, no communication."""
    params = list(model.parameters())
    params = params[: max(1, round(len(params) * fraction))]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = torch.optim.Adam(params, lr=1e-4)
    optimizer.step()  # creates the state
    return slowest_median(optimizer.step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=768)
    # 3, not more: each rank keeps five set-ups alive (model, gradients, Adam state, buckets); a fourth layer added
    # about 90 MiB to the 2-rank launch (1317 MiB against 1225) and took lesson 11 within 20 MiB of its 1.5 GiB budget
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    rank, world_size, _ = init_distributed("gloo")  # this machine's CPU: the prediction is for it
    inputs = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(rank))

    sizes = [4096 * 4**k for k in range(7)]  # 4 KB .. 16 MB
    sweep = []
    for size in sizes:
        tensor = torch.ones(size // 4)
        dist.all_reduce(tensor)  # warm-up
        sweep.append(slowest_median(lambda tensor=tensor: dist.all_reduce(tensor), repeats=5))
    progress(1, total=4)

    weight, activations = torch.randn(args.width, args.width), torch.randn(args.batch, args.width)
    matmul = slowest_median(lambda: activations @ weight, repeats=20)
    flop_rate = 2 * args.batch * args.width * args.width / matmul
    adam = {fraction: adam_seconds(build(args.width, args.layers), fraction, args.steps) for fraction in (1.0, 0.5)}
    progress(2, total=4)

    # one group per rank, made by every rank in the same order: FSDP2 over a group of one has no peer to talk to
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    setups = {}
    for mode in ("local", "ddp", "zero1", "fsdp", "fsdp_alone"):
        model = build(args.width, args.layers)
        if mode.startswith("fsdp"):
            mesh = DeviceMesh.from_group(alone, "cpu") if mode == "fsdp_alone" else None
            for layer in model:
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        elif mode == "local":  # no communication at all: what compute and Adam cost together
            optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        else:
            model = DDP(model)
            optimizer = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
                         if mode == "zero1" else torch.optim.Adam(model.parameters(), lr=1e-4))
        for _ in range(args.warmup):
            training_step(model, optimizer, inputs)
        setups[mode] = (model, optimizer)
    # Round robin, one step of each mode per round: a neighbour's load falls on every mode alike.
    samples = {mode: [] for mode in setups}
    for _ in range(args.steps):
        for mode, (model, optimizer) in setups.items():
            samples[mode].append(slowest_median(lambda m=model, o=optimizer: training_step(m, o, inputs), 1))
    steps = {mode: statistics.median(times) for mode, times in samples.items()}
    if rank == 0:
        print("  ".join(f"{mode} {seconds * 1e3:.1f} ms" for mode, seconds in steps.items()))
    progress(4, total=4)
    result(sizes=sizes, sweep_seconds=sweep, flop_rate=flop_rate, adam_seconds={"full": adam[1.0], "half": adam[0.5]},
           step_seconds=steps, n_params=sum(p.numel() for p in build(args.width, args.layers).parameters()),
           tensors=2 * args.layers, width=args.width, layers=args.layers, batch=args.batch, world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
