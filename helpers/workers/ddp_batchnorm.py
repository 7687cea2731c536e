"""BatchNorm under DDP: what forward_sync_buffers (formerly broadcast_buffers) syncs, and what it cannot.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_batchnorm.py --per-rank-batch 16 --steps 3

A BatchNorm layer keeps running statistics in *buffers*, not parameters, and normalises each batch
with that batch's own mean and variance. DDP averages gradients only. With forward_sync_buffers=True
(the default; DistributedDataParallel._pre_forward calls _sync_buffers) rank 0's buffers are
broadcast at the start of every forward. Either way each rank normalises with its *own* batch's
statistics, so the gradient is not one big batch's. SyncBatchNorm computes the statistics over all
ranks (torch/nn/modules/_functions.py); in torch 2.14 it accepts only GPU-like devices: on the CPU, DDP refuses
to wrap it, and the layer alone refuses a CPU input in a training forward (the last outcome, without DDP).
"""
import argparse
import itertools

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from helpers.kit.data import load
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.tensors import flat, tensor_checksum

MODES = {"BatchNorm, forward_sync_buffers=True": True, "BatchNorm, forward_sync_buffers=False": False,
         "SyncBatchNorm": True}


def batchnorm_mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 10))


def first_gradient(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    nn.functional.cross_entropy(model(images), labels).backward()
    return flat([p.grad for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    _, world_size, device = init_distributed()
    train_set, _ = load(train=True, limit=args.per_rank_batch * world_size * args.steps)
    images, labels = (t.to(device) for t in train_set.tensors)
    global_batch = args.per_rank_batch * world_size
    reference = first_gradient(batchnorm_mlp().to(device), images[:global_batch], labels[:global_batch])

    loader = DataLoader(train_set, batch_size=args.per_rank_batch,
                        sampler=DistributedSampler(train_set, shuffle=False))  # global batch j, split
    outcomes = {}
    for mode, sync_buffers in MODES.items():
        model = batchnorm_mlp().to(device)
        if mode == "SyncBatchNorm":
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        seen: list[str] = []  # running_mean's checksum as the BatchNorm layer starts each forward
        model[2].register_forward_pre_hook(lambda layer, _, seen=seen: seen.append(
            tensor_checksum([layer.running_mean])))
        outcome = {}
        try:
            ddp = DDP(model, forward_sync_buffers=sync_buffers)
            optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
            for step, (x, y) in enumerate(itertools.islice(loader, args.steps)):
                optimizer.zero_grad()
                gradient = first_gradient(ddp, x.to(device), y.to(device))
                if step == 0:
                    outcome["gradient_diff"] = (gradient - reference).abs().max().item()
                optimizer.step()
            outcome["running_mean_at_forward"] = seen
        except ValueError as error:  # SyncBatchNorm on a CPU: DDP's constructor refuses it
            outcome["error"] = f"{type(error).__name__}: {error}"
        outcomes[mode] = outcome
    # the layer's own rule, without DDP: a training forward, with a process group, on this device
    alone = nn.SyncBatchNorm.convert_sync_batchnorm(batchnorm_mlp()).to(device)
    try:
        alone(images[:args.per_rank_batch])
        outcomes["SyncBatchNorm, without DDP"] = {"forward": "ran"}
    except ValueError as error:  # on a CPU: SyncBatchNorm.forward refuses the input
        outcomes["SyncBatchNorm, without DDP"] = {"error": f"{type(error).__name__}: {error}"}
    result(outcomes=outcomes, device=device.type)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
