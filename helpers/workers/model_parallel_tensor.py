"""Tensor parallelism by hand: a column-parallel Linear then a row-parallel Linear, one all-reduce.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_tensor.py

Plain:    y = W2 relu(W1 x)          W1: [hidden, in], W2: [out, hidden]
Parallel: rank r keeps rows r of W1 (a slice of the hidden units) and the matching columns of W2.
Each rank computes a partial y from its slice; an all-reduce sums the partials into the full y.
In backward the mirror image holds: the gradient of x is a sum over ranks (the "f" operator below).
Every rank checks output and gradients against the plain layers. Works with one process.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn

from helpers.worker import result


class SumOverRanks(torch.autograd.Function):
    """g: all-reduce in forward (add the partial outputs), identity in backward."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CopyToRanks(torch.autograd.Function):
    """f: identity in forward (every rank has x), all-reduce in backward (x fed every rank's slice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        total = grad.clone()
        dist.all_reduce(total)
        return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")

    torch.manual_seed(0)  # every rank builds the same plain layers and the same input
    plain1 = nn.Linear(args.features, args.hidden, bias=False).to(device)
    plain2 = nn.Linear(args.hidden, args.features, bias=False).to(device)
    x = torch.randn(args.batch, args.features, device=device, requires_grad=True)

    # Rank r's slice of the hidden units: rows of W1 (column-parallel), columns of W2 (row-parallel).
    rows = slice(rank * args.hidden // world_size, (rank + 1) * args.hidden // world_size)
    w1 = plain1.weight.detach()[rows].clone().requires_grad_()
    w2 = plain2.weight.detach()[:, rows].clone().requires_grad_()
    x_parallel = x.detach().clone().requires_grad_()

    partial = torch.relu(CopyToRanks.apply(x_parallel) @ w1.T) @ w2.T
    y_parallel = SumOverRanks.apply(partial)
    y_parallel.sum().backward()

    y = plain2(torch.relu(plain1(x)))
    y.sum().backward()
    diffs = {"output": (y_parallel - y).abs().max().item(),
             "grad_w1": (w1.grad - plain1.weight.grad[rows]).abs().max().item(),
             "grad_w2": (w2.grad - plain2.weight.grad[:, rows]).abs().max().item(),
             "grad_x": (x_parallel.grad - x.grad).abs().max().item()}
    result(w1_shape=list(w1.shape), w2_shape=list(w2.shape), diffs=diffs,
           full_shapes=[list(plain1.weight.shape), list(plain2.weight.shape)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
