"""Naive model parallelism: each rank holds some of the layers; activations go forward, gradients back.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_naive.py --steps 3

Rank r runs layers r of `split_stages(mlp(...), world_size)`. It receives its input from rank r-1
(dist.recv), sends its output to rank r+1 (dist.send), and in backward does the same in reverse
with gradients. Only one rank computes at any moment: the others wait. `--stage-ms` adds a fixed
compute time to each stage (as in model_parallel_pipeline.py). Every rank also keeps an unsplit copy
of the model to check that the split loss and gradients are the same. Works with one process.
The timeline is read on the CPU (clocks at autograd marks): on gloo/CPU that is when a stage computes; on
nccl/CUDA it is when the CPU queued the work (time GPU stages with CUDA events instead).
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn

from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import SimulatedWork, Stopwatch
from helpers.kit.models import mlp, split_stages
from helpers.kit.reporting import report, result
from helpers.kit.tensors import max_abs_diff


def train_step(stage: nn.Module, images: torch.Tensor, labels: torch.Tensor, boundary: tuple[int, int]):
    """Forward and backward through this rank's layers; activations go forward, their gradients come back."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    first, last = rank == 0, rank == world_size - 1
    if first:
        inputs = images
    else:
        inputs = torch.empty(boundary, device=images.device, requires_grad=True)
        dist.recv(inputs.data, src=rank - 1)  # wait for the previous rank's activations
    outputs = stage(inputs)
    loss = None
    if last:
        loss = nn.functional.cross_entropy(outputs, labels)
        loss.backward()
    else:
        dist.send(outputs.detach(), dst=rank + 1)
        grad = torch.empty_like(outputs)
        dist.recv(grad, src=rank + 1)  # wait for the next rank's gradient
        outputs.backward(grad)
    if not first:
        dist.send(inputs.grad, dst=rank - 1)
    return loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden-layers", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=256, help="samples per step (every stage sees all)")
    parser.add_argument("--steps", type=int, default=3, help="training steps in total; the last is recorded")
    parser.add_argument("--stage-ms", type=float, default=200.0, help="simulated forward time of one stage")
    args = parser.parse_args()

    rank, world_size, device = init_distributed()
    last = rank == world_size - 1

    unsplit = mlp(args.width, args.hidden_layers).to(device)  # same seed on every rank: same weights
    layers = split_stages(mlp(args.width, args.hidden_layers), world_size)[rank].to(device)
    stage = Stopwatch(nn.Sequential(layers, SimulatedWork(args.stage_ms / args.global_batch)))
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.global_batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.global_batch,), generator=generator).to(device)
    # Shapes are fixed, so each rank can allocate its receive buffers up front.
    boundary = (args.global_batch, args.width)

    for step in range(args.steps):
        stage.zero_grad()
        stage.clear()
        dist.barrier()  # start together, so that the timeline shows only the waiting the split causes
        loss = train_step(stage, images, labels, boundary)
        if last:
            report(step=step, loss=loss.item())
    events = [{"rank": rank, "kind": kind, "start": start, "end": end} for kind, start, end in stage.intervals()]

    # The check: the unsplit model on the same batch gives the same loss and the same gradients.
    unsplit_loss = nn.functional.cross_entropy(unsplit(images), labels)
    unsplit_loss.backward()
    grad_diff = max_abs_diff([p.grad for p in layers.parameters()],
                             [p.grad for p in split_stages(unsplit, world_size)[rank].parameters()])
    loss_diff = abs(loss.item() - unsplit_loss.item()) if last else None
    result(events=events, grad_diff=grad_diff, loss_diff=loss_diff, loss=loss.item() if last else None,
           backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
