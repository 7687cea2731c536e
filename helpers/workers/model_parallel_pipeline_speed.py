"""Does micro-batching pay on this machine? GPipe step times at several m, the settings taking turns in one launch.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_pipeline_speed.py
    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_pipeline_speed.py --rounds 9

Two pipelines of two stages, real compute only (no sleep): a wide MLP (1024 units, 4 hidden layers, 1024
samples a step), whose stages compute for tens of milliseconds per micro-batch, and the lesson's narrow one (256
units, 3 hidden layers, 256 samples), whose stages compute for about a millisecond per micro-batch. Settings,
each one training step of GPipe:
- wide, m = 1, 2 and 4 micro-batches;
- wide, m = 4 with every thread of both ranks pinned to one CPU core (the control: the two stages cannot compute
  at the same moment, so whatever micro-batching gains there does not come from the stages overlapping);
- narrow, m = 1 and m = 8.
The settings take turns (helpers/kit/timing.py: a shuffled order each round, the same on every rank, a barrier
before each turn), after a warm-up round; each rank times its own step, wall and CPU, and hands the samples back.
Linux only for the pinned control (os.sched_setaffinity); elsewhere, or with fewer than 2 cores, it is left out.
gloo and the CPU on every machine, GPUs or not: the question is whether two CPU cores compute at once, and on
nccl/CUDA these CPU clocks would time the queueing of GPU work, not the work (time GPU stages with CUDA events).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from helpers.kit.distributed import init_distributed
from helpers.kit.models import mlp, split_stages
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns


def pin_all_threads(cpus: set[int]) -> None:
    """Run every thread of this process (torch's, gloo's) on `cpus` only."""
    for thread in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(thread), cpus)
        except (ProcessLookupError, PermissionError):  # a thread that ended meanwhile
            pass


def gpipe_step(layers: nn.Module, microbatches: int, images: torch.Tensor, labels: torch.Tensor):
    """One training step of GPipe with `microbatches` micro-batches, as a callable for take_turns.

    A stage of its own per setting (a stage prepares its buffers for one number of micro-batches), on shared layers.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    stage = PipelineStage(layers, rank, world_size, images.device)
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches, loss_fn=nn.functional.cross_entropy)

    def step() -> None:
        layers.zero_grad()
        if stage.is_first and stage.is_last:  # one process: the whole model is one stage
            schedule.step(images, target=labels)
        elif stage.is_first:
            schedule.step(images)
        elif stage.is_last:
            schedule.step(target=labels)
        else:
            schedule.step()
    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wide", type=int, default=1024, help="units per hidden layer of the wide model")
    parser.add_argument("--narrow", type=int, default=256, help="units per hidden layer of the narrow model")
    parser.add_argument("--wide-hidden-layers", type=int, default=4)
    parser.add_argument("--narrow-hidden-layers", type=int, default=3)
    parser.add_argument("--wide-batch", type=int, default=1024, help="samples per step of the wide model")
    parser.add_argument("--narrow-batch", type=int, default=256, help="samples per step of the narrow model")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    rank, world_size, device = init_distributed("gloo")  # the CPU, also on a GPU machine (see above)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.wide_batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.wide_batch,), generator=generator).to(device)
    narrow_images, narrow_labels = images[:args.narrow_batch], labels[:args.narrow_batch]
    stages = {name: split_stages(mlp(width, hidden_layers), world_size)[rank].to(device)
              for name, width, hidden_layers in (("wide", args.wide, args.wide_hidden_layers),
                                                 ("narrow", args.narrow, args.narrow_hidden_layers))}
    settings = {f"wide m={m}": gpipe_step(stages["wide"], m, images, labels) for m in (1, 2, 4)}
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    if len(allowed) >= 2 and world_size > 1:
        wide_four = gpipe_step(stages["wide"], 4, images, labels)

        def one_core() -> None:
            pin_all_threads({min(allowed)})
            try:
                wide_four()
            finally:
                pin_all_threads(allowed)
        settings["wide m=4, one core"] = one_core
    settings.update({f"narrow m={m}": gpipe_step(stages["narrow"], m, narrow_images, narrow_labels)
                     for m in (1, 8)})

    turns = 0

    def between() -> None:  # all ranks start each turn together; the bar moves once per turn
        nonlocal turns
        progress(turns, total=(args.rounds + 1) * len(settings))
        turns += 1
        dist.barrier()

    timings = take_turns(settings, rounds=args.rounds, warmup=1, seed=0, between=between)
    progress(turns, total=turns)
    result(timings={name: timing.as_dict() for name, timing in timings.items()}, cpus=len(allowed),
           threads=torch.get_num_threads(), backend=dist.get_backend(),
           stage_params={name: sum(p.numel() for p in layers.parameters()) for name, layers in stages.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
