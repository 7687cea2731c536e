"""Tensor parallelism: a column-parallel Linear then a row-parallel Linear, by hand and with PyTorch's API.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_tensor.py

Plain:    y = W2 relu(W1 x)          W1: [hidden, in], W2: [out, hidden]
Parallel: rank r keeps rows r of W1 (a slice of the hidden units) and the matching columns of W2.
Each rank computes a partial y from its slice; an all-reduce sums the partials into the full y.
In backward the mirror image holds: the gradient of x is a sum over ranks (the "f" operator below).
Then the same pair with torch.distributed.tensor.parallel: a DeviceMesh over the ranks and
parallelize_module with ColwiseParallel and RowwiseParallel, which shard the weights as DTensors and
insert the same two communications. Every rank checks output and gradients of both against the plain
layers, and counts the all-reduces the API's version runs. Works with one process.
"""
import argparse
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.tensors import max_abs_diff


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


def by_hand(plain1: nn.Linear, plain2: nn.Linear, x: torch.Tensor):
    """This rank's slice of the hidden units: rows of W1 (column-parallel), the same columns of W2 (row-parallel)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    hidden = plain1.out_features
    rows = slice(rank * hidden // world_size, (rank + 1) * hidden // world_size)
    w1 = plain1.weight.detach()[rows].clone().requires_grad_()
    w2 = plain2.weight.detach()[:, rows].clone().requires_grad_()
    x_parallel = x.detach().clone().requires_grad_()
    partial = torch.relu(CopyToRanks.apply(x_parallel) @ w1.T) @ w2.T  # a partial y from this slice
    return w1, w2, x_parallel, SumOverRanks.apply(partial)  # the all-reduce adds the partials


def with_the_api(plain1: nn.Linear, plain2: nn.Linear, x: torch.Tensor, y: torch.Tensor, rows: slice,
                 device: torch.device) -> dict:
    """The same pair through parallelize_module; returns local weight shapes, placements, diffs, all-reduces."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    pair = nn.Sequential(nn.Linear(plain1.in_features, plain1.out_features, bias=False), nn.ReLU(),
                         nn.Linear(plain2.in_features, plain2.out_features, bias=False)).to(device)
    pair.load_state_dict({"0.weight": plain1.weight, "2.weight": plain2.weight})
    parallelize_module(pair, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x_api = x.detach().clone().requires_grad_()
    with CommDebugMode() as comms:  # counts the collectives DTensor runs
        y_api = pair(x_api)
        y_api.sum().backward()
    counts = Counter({str(op).split(".")[-1]: n for op, n in comms.get_comm_counts().items()})
    return {"w1_local": list(pair[0].weight.to_local().shape), "w2_local": list(pair[2].weight.to_local().shape),
            "placements": [repr(pair[0].weight.placements[0]), repr(pair[2].weight.placements[0])],
            "diffs": {"output": max_abs_diff(y_api, y),
                      "grad_w1": max_abs_diff(pair[0].weight.grad.to_local(), plain1.weight.grad[rows]),
                      "grad_w2": max_abs_diff(pair[2].weight.grad.to_local(), plain2.weight.grad[:, rows]),
                      "grad_x": max_abs_diff(x_api.grad, x.grad)},
            "collectives": dict(counts)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=8, help="samples per step (every rank sees all)")
    args = parser.parse_args()

    rank, world_size, device = init_distributed()

    torch.manual_seed(0)  # every rank builds the same plain layers and the same input
    plain1 = nn.Linear(args.features, args.hidden, bias=False).to(device)
    plain2 = nn.Linear(args.hidden, args.features, bias=False).to(device)
    x = torch.randn(args.global_batch, args.features, device=device, requires_grad=True)

    w1, w2, x_parallel, y_parallel = by_hand(plain1, plain2, x)
    y_parallel.sum().backward()
    rows = slice(rank * args.hidden // world_size, (rank + 1) * args.hidden // world_size)

    y = plain2(torch.relu(plain1(x)))
    y.sum().backward()
    diffs = {"output": max_abs_diff(y_parallel, y),
             "grad_w1": max_abs_diff(w1.grad, plain1.weight.grad[rows]),
             "grad_w2": max_abs_diff(w2.grad, plain2.weight.grad[:, rows]),
             "grad_x": max_abs_diff(x_parallel.grad, x.grad)}
    result(w1_shape=list(w1.shape), w2_shape=list(w2.shape), diffs=diffs,
           full_shapes=[list(plain1.weight.shape), list(plain2.weight.shape)],
           api=with_the_api(plain1, plain2, x, y, rows, device))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
