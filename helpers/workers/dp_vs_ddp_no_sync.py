"""Gradient accumulation with DDP's no_sync(): fewer all-reduce calls, the same gradients.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_no_sync.py --accumulate 4 --per-rank-batch 8

Each rank accumulates gradients over `accumulate` micro-batches of `per-rank-batch` samples three times: once syncing on
every backward, once inside no_sync() for all but the last, and once with only the backward inside no_sync() (the
forward outside: DDP still syncs). It counts the all-reduce calls (comm hook) and compares both results with one process
that sees every rank's micro-batches at once.
"""
import argparse
import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import AllreduceCounter, counting_allreduce_hook
from helpers.kit.models import mlp
from helpers.kit.reporting import result
from helpers.kit.tensors import max_abs_diff


def accumulate(model: DDP, batches: list[tuple[torch.Tensor, torch.Tensor]], use_no_sync: bool) -> list[torch.Tensor]:
    """Sum the gradients of the mean loss over all micro-batches; return them."""
    model.zero_grad(set_to_none=True)
    for index, (images, labels) in enumerate(batches):
        last = index == len(batches) - 1
        # Inside no_sync, backward only accumulates locally; the last backward all-reduces the sum.
        context = model.no_sync() if use_no_sync and not last else contextlib.nullcontext()
        with context:
            loss = torch.nn.functional.cross_entropy(model(images), labels) / len(batches)
            loss.backward()
    return [p.grad.clone() for p in model.parameters()]


def accumulate_forward_outside(model: DDP, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The mistake: every forward outside no_sync(), only the backward inside it. DDP decides in the forward."""
    model.zero_grad(set_to_none=True)
    for index, (images, labels) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(model(images), labels) / len(batches)
        context = model.no_sync() if index < len(batches) - 1 else contextlib.nullcontext()
        with context:
            loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("--per-rank-batch", type=int, default=8, help="samples per rank in each micro-batch")
    args = parser.parse_args()

    rank, world_size, device = init_distributed()

    # Every rank builds every rank's micro-batches (same seed), then keeps its own.
    generator = torch.Generator().manual_seed(0)
    shape = (world_size, args.accumulate, args.per_rank_batch)
    all_images = torch.rand(*shape, 1, 28, 28, generator=generator).to(device)
    all_labels = torch.randint(0, 10, shape, generator=generator).to(device)
    mine = [(all_images[rank, i], all_labels[rank, i]) for i in range(args.accumulate)]

    torch.manual_seed(0)
    plain = mlp(64, 2).to(device)
    model = DDP(plain, bucket_cap_mb=25)
    counter = AllreduceCounter()
    model.register_comm_hook(counter, counting_allreduce_hook)

    counts = {}
    grads = {}
    for use_no_sync in (False, True):
        counter.reset()
        grads[use_no_sync] = accumulate(model, mine, use_no_sync)
        counts[use_no_sync] = counter.calls

    counter.reset()
    accumulate_forward_outside(model, mine)
    calls_forward_outside = counter.calls

    # The reference: one process, the whole global batch, mean loss.
    plain.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(plain(all_images.flatten(0, 2)), all_labels.flatten()).backward()
    reference = [p.grad for p in plain.parameters()]
    result(calls_every_backward=counts[False], calls_with_no_sync=counts[True],
           calls_forward_outside_no_sync=calls_forward_outside,
           diff_every_backward=max_abs_diff(grads[False], reference),
           diff_with_no_sync=max_abs_diff(grads[True], reference))
    print(f"rank {rank}: all-reduce calls {counts[False]} -> {counts[True]} with no_sync "
          f"({calls_forward_outside} with only the backward inside no_sync)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
