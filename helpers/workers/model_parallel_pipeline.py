"""Pipeline parallelism with torch.distributed.pipelining: micro-batches keep every stage busy.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_pipeline.py --microbatches 1 2 4 8
    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_pipeline.py --stage-ms 0  # no sleep

The model is split as in model_parallel_naive.py, one stage per rank, each wrapped in a PipelineStage. A
schedule (GPipe: all forwards then all backwards; 1F1B: alternate once the pipeline is full) cuts
the batch into micro-batches and moves activations and gradients between ranks for us.
`--stage-ms` adds a simulated compute time to every stage (a sleep of that many milliseconds per whole
batch, in forward and again in backward, split evenly over the micro-batches), so that on a small CPU the
stages' work, not the messages between them, fills the timeline; `--stage-ms 0` leaves the real compute
only. Every rank records when its stage computes (wall clock, and this thread's CPU time inside each
interval) and how many bytes of activations it holds at most. Of the steps after a warm-up it keeps the one
whose slower rank had the shortest span from its first compute start to its last compute end, so that a moment
when the machine is busy elsewhere weighs less: a choice by span, not by idle time (the kept step's idle share
need not be the lowest of the recorded steps), and not an average; every recorded step's timeline comes back too
(`every_step`), for tables that show them all.
It also checks loss and gradients against the unsplit model. Works with one process (a one-stage pipeline).
Whether micro-batching pays with real compute is model_parallel_pipeline_speed.py's question.
The timelines are read on the CPU (wall and thread clocks at autograd marks). On gloo/CPU that is when the
stage computes; on nccl/CUDA it is when the CPU queued the kernels and the messages, so time GPU stages with
CUDA events (torch.cuda.Event(enable_timing=True)) or torch.cuda.synchronize() instead.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import SavedActivations, SimulatedWork, Stopwatch
from helpers.kit.models import mlp, split_stages
from helpers.kit.reporting import progress, result
from helpers.kit.tensors import max_abs_diff

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def fastest_step(steps: list[list[dict]]) -> int:
    """The step whose slowest rank had the shortest compute span (first start to last end), agreed by all ranks.

    Chosen by span, not by idle share: the kept step's idle share need not be the lowest.
    """
    # on the process group's device: a group made with a bare "nccl" has no backend for CPU tensors
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    spans = torch.tensor([max(e["end"] for e in events) - min(e["start"] for e in events) for events in steps],
                         device=device)
    dist.all_reduce(spans, op=dist.ReduceOp.MAX)
    return int(spans.argmin())


def pipeline_step(schedule, images: torch.Tensor, labels: torch.Tensor, losses: list) -> None:
    """One training step on every rank: the first stage gets the inputs, the last the targets (and the losses)."""
    first, last = dist.get_rank() == 0, dist.get_rank() == dist.get_world_size() - 1
    if first and last:
        schedule.step(images, target=labels, losses=losses)
    elif first:
        schedule.step(images)
    elif last:
        schedule.step(target=labels, losses=losses)
    else:
        schedule.step()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden-layers", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step, cut into micro-batches")
    parser.add_argument("--steps-per-schedule", type=int, default=3,
                        help="the first warms up; of the others the fastest is kept")
    parser.add_argument("--stage-ms", type=float, default=600.0, help="simulated forward ms of a stage, whole batch")
    args = parser.parse_args()
    if args.steps_per_schedule < 2:
        parser.error("--steps-per-schedule must be at least 2: a warm-up, then the recorded steps")

    rank, world_size, device = init_distributed()
    last = rank == world_size - 1

    unsplit = mlp(args.width, args.hidden_layers).to(device)  # same seed on every rank: same weights
    layers = split_stages(mlp(args.width, args.hidden_layers), world_size)[rank].to(device)
    simulated = SimulatedWork(args.stage_ms / args.global_batch)
    watched = Stopwatch(nn.Sequential(layers, simulated))
    stage = PipelineStage(watched, rank, world_size, device)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.global_batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.global_batch,), generator=generator).to(device)

    # Reference: the unsplit model's loss and this rank's layers' gradients on the whole batch.
    unsplit_loss = nn.functional.cross_entropy(unsplit(images), labels)
    unsplit_loss.backward()
    unsplit_grads = [p.grad for p in split_stages(unsplit, world_size)[rank].parameters()]

    timelines, checks, activations, every_step = {}, {}, {}, {}
    configs = [(name, m) for name in args.schedules for m in args.microbatches
               if not (name == "1f1b" and m < world_size)]  # 1F1B needs at least one micro-batch per stage
    for done, (name, microbatches) in enumerate(configs):
        schedule = SCHEDULES[name](stage, n_microbatches=microbatches, loss_fn=nn.functional.cross_entropy)
        recorded = []
        for step in range(args.steps_per_schedule):  # the first step also runs an extra forward to learn shapes
            simulated.ms_per_sample = args.stage_ms / args.global_batch if step > 0 else 0.0
            watched.zero_grad()
            watched.clear()
            dist.barrier()
            losses: list[torch.Tensor] = []
            with SavedActivations(watched) as saved:  # this stage's activations, over the whole step
                pipeline_step(schedule, images, labels, losses)
            if step > 0:
                events = [{"rank": rank, "kind": kind, "start": start, "end": end, "cpu": cpu}
                          for (kind, start, end), cpu in zip(watched.intervals(), watched.cpu_seconds(),
                                                             strict=True)]
                # Every micro-batch saves the same bytes, so saved.bytes / m is one micro-batch's activations.
                recorded.append((events, {"peak": saved.peak, "per_microbatch": saved.bytes / microbatches}))
        key = f"{name} m={microbatches}"
        timelines[key], activations[key] = recorded[fastest_step([events for events, _ in recorded])]
        every_step[key] = [events for events, _ in recorded]  # all recorded steps, not only the chosen one
        grad_diff = max_abs_diff([p.grad for p in layers.parameters()], unsplit_grads)
        # Equal micro-batches: the mean of their losses is the loss of the whole batch.
        loss_diff = abs(torch.stack(losses).mean().item() - unsplit_loss.item()) if last else None
        checks[key] = {"grad_diff": grad_diff, "loss_diff": loss_diff}
        progress(done + 1, total=len(configs))
    result(timelines=timelines, every_step=every_step, checks=checks, activations=activations,
           loss=unsplit_loss.item(), backend=dist.get_backend(),
           threads=torch.get_num_threads())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
