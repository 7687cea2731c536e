"""DDP training with one planted bug at a time, the checks that catch it, and its fix.

    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_ddp.py --bug unused-layer
    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_ddp.py --bug unused-layer --fix

A small MLP learns a fixed random regression task; every rank draws its own batches. --bug:
  unused-layer  forward uses one layer on rank 1 only (rank-dependent control flow inside the model)
                fix: DistributedDataParallel(..., find_unused_parameters=True)
  uneven        rank 0 has one batch more than rank 1 (a data shard that does not divide evenly);
                at the end every rank meets at a barrier, as before saving the final model
                fix: `with model.join():` (torch.distributed.algorithms.Join) shadows the missing all-reduces
  outside-ddp   a learnable output scale lives outside the module DDP wraps: each rank updates it alone
                fix: the scale is part of the module DDP wraps
  nan           rank 1's batch at step 5 holds an inf (a corrupt sample); the gradient all-reduce spreads it
                fix: every rank skips a step on which any rank's loss is not finite (agreed by one all-reduce)
Checks: --checksum-every N   compare parameter and buffer checksums across ranks every N steps
        --nan-check          every step, before backward: which ranks have a non-finite loss? stop at the first
        --anomaly            torch.autograd.set_detect_anomaly(True): the backward op that made a NaN raises
"""
import argparse
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import diverged_tensors, nonfinite_ranks
from helpers.kit.reporting import report, result
from helpers.kit.tensors import checksums

NAN_RANK, NAN_STEP = 1, 5


class Regressor(nn.Module):
    def __init__(self, use_extra_on: set[int]) -> None:
        super().__init__()
        self.hidden, self.extra, self.out = nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 1)
        self.scale = nn.Parameter(torch.ones(1))
        self.use_extra = dist.get_rank() in use_extra_on

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.hidden(x))
        if self.use_extra:  # rank-dependent control flow: the bug of --bug unused-layer
            h = torch.relu(self.extra(h))
        return self.out(h) * self.scale


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=["none", "unused-layer", "uneven", "outside-ddp", "nan"], default="none")
    parser.add_argument("--fix", action="store_true")
    parser.add_argument("--steps", type=int, default=8)
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--per-rank-batch", type=int, default=16)
    batch.add_argument("--global-batch", type=int, default=None, help="split evenly across the ranks instead")
    parser.add_argument("--checksum-every", type=int, default=0)
    parser.add_argument("--nan-check", action="store_true")
    parser.add_argument("--anomaly", action="store_true")
    parser.add_argument("--timeout", type=float, default=60.0)
    return parser.parse_args()


def batches(args: argparse.Namespace, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's shard of a fixed task: y = x @ teacher. With --bug uneven, rank 0 holds one batch more."""
    teacher = torch.randn(8, 1, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(100 + rank)
    count = args.steps - (1 if args.bug == "uneven" and rank != 0 else 0)
    data = []
    for step in range(1, count + 1):
        x = torch.randn(args.per_rank_batch, 8, generator=generator)
        if args.bug == "nan" and (rank, step) == (NAN_RANK, NAN_STEP):
            x[0, 0] = float("inf")  # one corrupt sample
        data.append((x, x @ teacher))
    return data


def main() -> None:
    args = parse_args()
    dist.set_debug_level_from_env()  # forked workers: read TORCH_DISTRIBUTED_DEBUG again (see debug_collectives)
    # gloo on every machine: the model and batches stay on the CPU (nccl serves only CUDA tensors)
    rank, world_size, _ = init_distributed("gloo", timeout=timedelta(seconds=args.timeout))
    if args.global_batch:
        args.per_rank_batch = args.global_batch // world_size
    torch.manual_seed(0)  # the same initial weights everywhere (DDP would broadcast rank 0's anyway)
    regressor = Regressor(use_extra_on={1} if args.bug == "unused-layer" else {0, 1})
    if args.bug == "outside-ddp" and not args.fix:
        # the bug: DDP wraps the layers only; the scale is applied outside, so its gradient stays local
        layers = DDP(nn.Sequential(regressor.hidden, nn.ReLU(), regressor.extra, nn.ReLU(), regressor.out))
        predict = lambda x: layers(x) * regressor.scale  # noqa: E731
    else:
        predict = DDP(regressor, find_unused_parameters=args.bug == "unused-layer" and args.fix)
    optimizer = torch.optim.SGD(regressor.parameters(), lr=0.05)
    torch.autograd.set_detect_anomaly(args.anomaly)
    joined = predict.join() if args.bug == "uneven" and args.fix else nullcontext()
    step, first_diverged, first_nonfinite, skipped = 0, None, None, []
    with joined:
        for step, (x, y) in enumerate(batches(args, rank), start=1):
            loss = nn.functional.mse_loss(predict(x), y)
            if args.nan_check or (args.bug == "nan" and args.fix):
                bad = nonfinite_ranks(loss)
                if bad and args.nan_check and first_nonfinite is None:
                    first_nonfinite = {"step": step, "ranks": bad}
                    print(f"step {step}: non-finite loss on rank(s) {bad}; stopping before backward", flush=True)
                    break
                if bad:  # the fix: every rank saw the same flags, so every rank skips this step
                    skipped.append(step)
                    continue
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"step {step}: loss {loss.item():.4f}", flush=True)
            report(step=step, loss=loss.item())
            if args.checksum_every and step % args.checksum_every == 0:
                names = diverged_tensors(regressor)
                if names and first_diverged is None:
                    first_diverged = {"step": step, "names": names}
                    print(f"step {step}: differs across ranks: {', '.join(names)}", flush=True)
    if args.bug == "uneven":
        dist.barrier()  # every rank meets before rank 0 saves the final model
    named = dict(regressor.named_parameters())
    result(steps=step, final_loss=loss.item(), checksums=dict(zip(named, checksums(named).tolist(), strict=True)),
           first_diverged=first_diverged, first_nonfinite=first_nonfinite, skipped=skipped)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
