"""Torch's own: DDP + AdamW, DDP + ZeroRedundancyOptimizer(AdamW), fully_shard + AdamW, counted the same way.

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_torch.py

The lesson's mlp (helpers.kit.zero.build_model), 5 AdamW steps on each rank's own data, three ways. For each,
every rank hands back the collectives of each step (helpers.kit.zero.CommLog: DDP through its default comm
hook, which calls dist.all_reduce; ZeroRedundancyOptimizer's dist.broadcast calls; FSDP2's
dist.all_gather_single and dist.reduce_scatter_single), the bytes of Adam state, gradients and parameters it
holds (read from the tensors), and how far its parameters are from DDP's. For ZeroRedundancyOptimizer also
which parameters (their sizes) each rank owns. Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.zero import CommLog, build_model, storage_bytes

log = CommLog().install()


def train(model, optimizer, steps: int, rank: int, device: torch.device) -> dict:
    record = {"steps": [], "grad_bytes": 0}
    for step in range(steps):
        generator = torch.Generator().manual_seed(1000 * step + rank)
        inputs, targets = torch.randn(8, 32, generator=generator), torch.randn(8, generator=generator)
        loss = (model(inputs.to(device)).sum(dim=-1) - targets.to(device)).pow(2).mean()
        loss.backward()
        record["grad_bytes"] = storage_bytes(p.grad for p in model.parameters())
        optimizer.step()
        optimizer.zero_grad()
        record["steps"].append(log.take())
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    record["state_bytes"] = storage_bytes(v for s in local.state.values() for k, v in s.items()
                                          if k in ("exp_avg", "exp_avg_sq"))
    record["param_bytes"] = storage_bytes(model.parameters())
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    record["params"] = [p.reshape(-1).cpu().tolist() for p in full]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    out = {}
    for mode in ("ddp", "torch_zero", "fsdp"):
        model, units, _ = build_model("mlp")
        model = model.to(device)
        if mode == "fsdp":
            for unit in units:
                fully_shard(unit)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        else:
            model = DDP(model)
            model.register_comm_hook(None, allreduce_hook)  # torch's default hook: one dist.all_reduce per bucket
            optimizer = (ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2)
                         if mode == "torch_zero" else torch.optim.AdamW(model.parameters(), lr=1e-2))
        out[mode] = train(model, optimizer, args.steps, rank, device)
        if mode == "torch_zero":  # ZeroRedundancyOptimizer._partition_parameters: whole tensors, largest first
            out[mode]["owned"] = [[p.numel() for group in groups for p in group["params"]]
                                  for groups in optimizer._partition_parameters()]
    for mode in ("torch_zero", "fsdp"):
        out[mode]["max_diff"] = max(max(abs(a - b) for a, b in zip(x, y, strict=True))
                                    for x, y in zip(out[mode]["params"], out["ddp"]["params"], strict=True))
    for record in out.values():
        del record["params"]
    result(world_size=world_size, n_params=sum(p.numel() for p in build_model("mlp")[0].parameters()), **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
