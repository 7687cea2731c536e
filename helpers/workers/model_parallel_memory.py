"""Where the memory goes: bytes of parameters, gradients, Adam state and activations held on each rank.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_memory.py --modes ddp zero1 fsdp

ddp:   every rank holds everything (ZeRO stage 0).
zero1: ZeroRedundancyOptimizer, each rank keeps Adam's state for its share of the parameters.
fsdp:  FSDP2 `fully_shard`, each rank keeps a shard of parameters, gradients and Adam state.
For each mode: one training step on random data, then each rank counts what its tensors hold.
Works with one process.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.model_parallel import SavedActivations, held_bytes, mlp
from helpers.worker import result


def wrap(model: nn.Module, mode: str, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer for one mode; they differ only in what each rank keeps."""
    if mode == "fsdp":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)  # one shard unit per layer: gathered just before it runs
        fully_shard(model)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "zero1":
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def adam_moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """exp_avg and exp_avg_sq this rank keeps (ZeroRedundancyOptimizer's local optimizer holds its share)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return [value for state in local.state.values() for key, value in state.items()
            if key in ("exp_avg", "exp_avg_sq")]


def measure(mode: str, args: argparse.Namespace, rank: int, world_size: int,
            device: torch.device) -> dict[str, int]:
    """One training step in this mode; then the bytes this rank's tensors hold."""
    model = mlp(args.width, args.hidden_layers).to(device)
    model, optimizer = wrap(model, mode, device)
    per_rank_batch = args.global_batch // world_size
    generator = torch.Generator().manual_seed(rank)
    images = torch.rand(per_rank_batch, 1, 28, 28, generator=generator).to(device)
    labels = torch.randint(0, 10, (per_rank_batch,), generator=generator).to(device)
    with SavedActivations(model) as saved:
        logits = model(images)
    nn.functional.cross_entropy(logits, labels).backward()
    optimizer.step()
    return {"params": held_bytes(model.parameters()),
            "grads": held_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": held_bytes(adam_moments(optimizer)),
            "activations": saved.bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["ddp", "zero1", "fsdp"], default=["ddp", "zero1", "fsdp"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden-layers", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)

    held = {mode: measure(mode, args, rank, world_size, device) for mode in args.modes}
    for mode, parts in held.items():
        print(f"rank {rank} {mode:>5}: " + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in parts.items()))
    n_params = sum(p.numel() for p in mlp(args.width, args.hidden_layers).parameters())
    result(n_params=n_params, per_rank_batch=args.global_batch // world_size, world_size=world_size, **held)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
