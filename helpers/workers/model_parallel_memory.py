"""Where the memory goes: what each rank's tensors hold under DDP, ZeRO-1 and FSDP, and the extras those sums leave out.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_memory.py --modes ddp zero1 fsdp

ddp:   every rank holds everything (ZeRO stage 0).
zero1: ZeroRedundancyOptimizer, each rank keeps Adam's state for its share of the parameters.
fsdp:  FSDP2 `fully_shard`, each rank keeps a shard of parameters, gradients and Adam state.
For each mode: one training step on random data, then each rank adds up the bytes its tensors hold.
Then two extras that the sums above leave out, measured as the bytes of storage alive:
- DDP's gradient buckets, a standing cost (one flat buffer per bucket, allocated when DDP builds its buckets and
  kept for the DDP object's lifetime, on top of the .grad tensors unless
  gradient_as_bucket_view=True makes the .grad tensors views into the buckets); a comm hook notes each bucket's
  storage, and since that note is a reference of ours, the worker also reports how many references besides
  ours hold each bucket once zero_grad() has freed the .grad tensors;
- FSDP's gathered (unsharded) parameters while a step runs, a temporary cost, with and without reshard_after_forward
  (their storages, FSDPParam.all_gather_outputs; not the flat buffer an all-gather first receives into).
Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import SavedActivations
from helpers.kit.models import mlp
from helpers.kit.reporting import result
from helpers.kit.tensors import own_bytes


def wrap(model: nn.Module, mode: str, device: torch.device) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model and optimizer for one mode; they differ only in what each rank keeps."""
    if mode == "fsdp":
        shard_every_linear(model, reshard_after_forward=True)
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "zero1":
        return model, ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)
    return model, torch.optim.Adam(model.parameters(), lr=1e-3)


def shard_every_linear(model: nn.Module, reshard_after_forward: bool) -> None:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, reshard_after_forward=reshard_after_forward)  # one unit per layer
    fully_shard(model, reshard_after_forward=reshard_after_forward)


def adam_moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """exp_avg and exp_avg_sq this rank keeps (ZeroRedundancyOptimizer's local optimizer holds its share)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return [value for state in local.state.values() for key, value in state.items()
            if key in ("exp_avg", "exp_avg_sq")]


def batch(args: argparse.Namespace, rank: int, world_size: int, device: torch.device):
    generator = torch.Generator().manual_seed(rank)
    per_rank_batch = args.global_batch // world_size
    images = torch.rand(per_rank_batch, 1, 28, 28, generator=generator).to(device)
    return images, torch.randint(0, 10, (per_rank_batch,), generator=generator).to(device)


def measure(mode: str, args: argparse.Namespace, rank: int, world_size: int,
            device: torch.device) -> dict[str, int]:
    """One training step in this mode; then the bytes this rank's tensors hold."""
    model, optimizer = wrap(mlp(args.width, args.hidden_layers).to(device), mode, device)
    images, labels = batch(args, rank, world_size, device)
    with SavedActivations(model) as saved:
        logits = model(images)
    nn.functional.cross_entropy(logits, labels).backward()
    optimizer.step()
    return {"params": own_bytes(model.parameters()),
            "grads": own_bytes(p.grad for p in model.parameters() if p.grad is not None),
            "optimizer": own_bytes(adam_moments(optimizer)),
            "activations": saved.bytes}


def ddp_gradient_storage(args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
                         bucket_view: bool) -> dict[str, int]:
    """Bytes of .grad tensors, and of all distinct storages behind .grad and DDP's buckets together."""
    model = DDP(mlp(args.width, args.hidden_layers).to(device), gradient_as_bucket_view=bucket_view)
    buckets: dict[int, torch.UntypedStorage] = {}

    def record_bucket(state, bucket):  # the default all-reduce, after noting the bucket's flat buffer
        buckets[bucket.index()] = bucket.buffer().untyped_storage()
        return allreduce_hook(state, bucket)

    model.register_comm_hook(None, record_bucket)
    images, labels = batch(args, rank, world_size, device)
    for _ in range(2):  # two steps: the second runs after DDP's one bucket rebuild (its buffers are the ones kept)
        model.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
    storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes() for p in model.parameters()}
    storages.update({s.data_ptr(): s.nbytes() for s in buckets.values()})
    grads = own_bytes(p.grad for p in model.parameters())
    # Our hook holds a reference to each bucket's storage, so the sum above could count a bucket only we kept.
    # Who else holds it: the storage's reference count minus ours (torch._C._storage_Use_Count, a private
    # function), after zero_grad() has freed the .grad tensors (set_to_none=True). The first .grad's storage,
    # held the same way, is the control: a storage nobody else keeps drops to 0.
    grad_storage = next(model.parameters()).grad.untyped_storage()
    model.zero_grad()

    def held_by_others(storage: torch.UntypedStorage) -> int:
        return torch._C._storage_Use_Count(storage._cdata) - 1  # minus our own reference

    return {"grads": grads, "grads_and_buckets": sum(storages.values()), "buckets": len(buckets),
            "bucket_holders_after_zero_grad": min(held_by_others(s) for s in buckets.values()),
            "grad_holders_after_zero_grad": held_by_others(grad_storage)}


def fsdp_gathered_peak(args: argparse.Namespace, rank: int, world_size: int, device: torch.device,
                       reshard_after_forward: bool) -> dict[str, int]:
    """Most bytes of gathered (unsharded) parameters alive at once during one FSDP training step."""
    model = mlp(args.width, args.hidden_layers).to(device)
    shard_every_linear(model, reshard_after_forward)
    params = [p for m in model.modules() if isinstance(m, FSDPModule) and (g := m._get_fsdp_state()._fsdp_param_group)
              for p in g.fsdp_params]
    peak = {"bytes": 0}
    free = FSDPParam.free_unsharded_param

    def measure_then_free(fsdp_param: FSDPParam) -> None:  # the peak is always just before a free
        alive = sum(t.untyped_storage().nbytes() for p in params for t in p.all_gather_outputs)
        peak["bytes"] = max(peak["bytes"], alive)
        free(fsdp_param)

    FSDPParam.free_unsharded_param = measure_then_free  # torch/distributed/fsdp/_fully_shard/_fsdp_param.py
    try:
        images, labels = batch(args, rank, world_size, device)
        nn.functional.cross_entropy(model(images), labels).backward()
    finally:
        FSDPParam.free_unsharded_param = free
    after = sum(t.untyped_storage().nbytes() for p in params for t in p.all_gather_outputs)
    largest = max(4 * sum(p.numel() for p in m.parameters(recurse=False)) for m in model if isinstance(m, nn.Linear))
    return {"peak": peak["bytes"], "after_step": after, "largest_layer": largest}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", choices=["ddp", "zero1", "fsdp"], default=["ddp", "zero1", "fsdp"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden-layers", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=64)
    args = parser.parse_args()

    rank, world_size, device = init_distributed()
    held = {mode: measure(mode, args, rank, world_size, device) for mode in args.modes}
    for mode, parts in held.items():
        print(f"rank {rank} {mode:>5}: " + ", ".join(f"{k} {v / 1e6:.3f} MB" for k, v in parts.items()))
    ddp_buckets = {name: ddp_gradient_storage(args, rank, world_size, device, bucket_view=name == "view")
                   for name in ("copy", "view")}
    fsdp_gathered = {name: fsdp_gathered_peak(args, rank, world_size, device, reshard_after_forward=name == "reshard")
                     for name in ("reshard", "keep")}
    n_params = sum(p.numel() for p in mlp(args.width, args.hidden_layers).parameters())
    result(n_params=n_params, per_rank_batch=args.global_batch // world_size, world_size=world_size,
           ddp_buckets=ddp_buckets, fsdp_gathered=fsdp_gathered, **held)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
