"""Pipeline parallelism with torch.distributed.pipelining: micro-batches keep every stage busy.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_pipeline.py --microbatches 1 2 4 8

The model is split as in model_parallel_naive.py, one stage per rank, each wrapped in a PipelineStage. A
schedule (GPipe: all forwards then all backwards; 1F1B: alternate once the pipeline is full) cuts
the batch into micro-batches and moves activations and gradients between ranks for us. Every rank
records when its stage computes, and checks loss and gradients against the unsplit model.
Works with one process (a one-stage pipeline).
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from helpers.model_parallel import Stopwatch, mlp, split_stages
from helpers.worker import progress, result

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden-layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    first, last = rank == 0, rank == world_size - 1

    unsplit = mlp(args.width, args.hidden_layers).to(device)
    watched = Stopwatch(split_stages(mlp(args.width, args.hidden_layers), world_size)[rank].to(device))
    stage = PipelineStage(watched, rank, world_size, device)
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.batch,), generator=generator).to(device)

    # Reference: the unsplit model's loss and this rank's layers' gradients on the whole batch.
    unsplit_loss = nn.functional.cross_entropy(unsplit(images), labels)
    unsplit_loss.backward()
    unsplit_grads = [p.grad for p in split_stages(unsplit, world_size)[rank].parameters()]

    timelines, checks = {}, {}
    configs = [(name, m) for name in args.schedules for m in args.microbatches
               if not (name == "1f1b" and m < world_size)]  # 1F1B needs at least one micro-batch per stage
    for done, (name, microbatches) in enumerate(configs):
        schedule = SCHEDULES[name](stage, n_microbatches=microbatches, loss_fn=nn.functional.cross_entropy)
        for _ in range(args.repeats):  # keep the last: the first step also runs an extra forward to learn shapes
            watched.zero_grad()
            watched.times.clear()
            dist.barrier()
            losses: list[torch.Tensor] = []
            if first and last:
                schedule.step(images, target=labels, losses=losses)
            elif first:
                schedule.step(images)
            elif last:
                schedule.step(target=labels, losses=losses)
            else:
                schedule.step()
        key = f"{name} m={microbatches}"
        timelines[key] = [{"rank": rank, "kind": kind, "start": start, "end": end}
                          for kind, start, end in watched.intervals()]
        pairs = zip(watched.parameters(), unsplit_grads, strict=True)
        grad_diff = max((p.grad - g).abs().max().item() for p, g in pairs)
        # Equal micro-batches: the mean of their losses is the loss of the whole batch.
        loss_diff = abs(torch.stack(losses).mean().item() - unsplit_loss.item()) if last else None
        checks[key] = {"grad_diff": grad_diff, "loss_diff": loss_diff}
        progress(done + 1, total=len(configs))
    result(timelines=timelines, checks=checks, loss=unsplit_loss.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
