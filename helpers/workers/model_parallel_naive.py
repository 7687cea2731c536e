"""Naive model parallelism: each rank holds some of the layers; activations go forward, gradients back.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_naive.py --repeats 3

Rank r runs layers r of `split_stages(mlp(...), world_size)`. It receives its input from rank r-1
(dist.recv), sends its output to rank r+1 (dist.send), and in backward does the same in reverse
with gradients. Only one rank computes at any moment: the others wait. Every rank also keeps an
unsplit copy of the model to check that the split loss and gradients are the same. Works with one process.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from helpers.model_parallel import Stopwatch, mlp, split_stages
from helpers.worker import report, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden-layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    first, last = rank == 0, rank == world_size - 1

    unsplit = mlp(args.width, args.hidden_layers).to(device)  # same seed on every rank: same weights
    stage = Stopwatch(split_stages(mlp(args.width, args.hidden_layers), world_size)[rank].to(device))
    generator = torch.Generator().manual_seed(0)
    images = torch.rand(args.batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (args.batch,), generator=generator).to(device)
    # Shapes are fixed, so each rank can allocate its receive buffers up front.
    boundary = (args.batch, args.width)

    for repeat in range(args.repeats):
        stage.zero_grad()
        stage.times.clear()
        dist.barrier()  # start together, so that the timeline shows only the waiting the split causes
        if first:
            inputs = images
        else:
            inputs = torch.empty(boundary, device=device, requires_grad=True)
            dist.recv(inputs.data, src=rank - 1)  # wait for the previous rank's activations
        outputs = stage(inputs)
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
        if last:
            report(step=repeat, loss=loss.item())
    events = [{"rank": rank, "kind": kind, "start": start, "end": end} for kind, start, end in stage.intervals()]

    # The check: the unsplit model on the same batch gives the same loss and the same gradients.
    unsplit_loss = nn.functional.cross_entropy(unsplit(images), labels)
    unsplit_loss.backward()
    my_layers = split_stages(unsplit, world_size)[rank]
    grad_diff = max((a.grad - b.grad).abs().max().item()
                    for a, b in zip(stage.parameters(), my_layers.parameters(), strict=True))
    loss_diff = abs(loss.item() - unsplit_loss.item()) if last else None
    result(events=events, grad_diff=grad_diff, loss_diff=loss_diff, loss=loss.item() if last else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
