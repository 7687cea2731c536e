"""Lesson 09's check harness: run one step of the lesson (ours or the learner's) beside torch's own, on every rank.

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_check.py --impl solution --stage zero3

--impl: a file with the learner's class (notebooks/my_zero3.py, ...) or `solution` (zero_solution.py).
--stage: bucketed (BucketedDDP), zero1, zero2 or zero3. For each of three models (helpers.zero_kit.build_model:
mlp, odd = no tensor divides by 2, tied = one weight shared) it trains 5 AdamW steps on each rank's own data,
with the class under test and with torch's DistributedDataParallel (and, for zero3, FSDP2's fully_shard),
from the same weights. Each rank hands back: its parameters and shards, the bytes its tensors hold (read from
the tensors), every collective issued in each step (helpers.zero_kit.CommLog; torch's DDP is counted through
its default comm hook, which calls dist.all_reduce), and markers for the ends of backward and of each unit's
forward. helpers/zero.py reads the results and decides. Works with one process.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.distributed import init_distributed
from helpers.reporting import result
from helpers.zero_kit import CommLog, build_model, storage_bytes

CLASSES = {"bucketed": "BucketedDDP", "zero1": "Zero1", "zero2": "Zero2", "zero3": "Zero3"}
MODELS, STEPS, LR, CAP_MB = ("mlp", "odd", "tied"), 5, 1e-2, 0.01  # cap 10 KiB: the mlp makes 2 buckets
log = CommLog().install()  # before the learner's file is loaded, so `from torch.distributed import ...` is seen


def load_class(impl: str, stage: str):
    path = Path(__file__).with_name("zero_solution.py") if impl == "solution" else Path(impl)
    sys.path.insert(0, str(path.parent))  # my_zero2.py may import my_zero1.py beside it
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, CLASSES[stage])


def batch(width: int, rank: int, step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
    return torch.randn(8, width, generator=generator).to(device), torch.randn(8, generator=generator).to(device)


def train(model, optimizer, width, device, rank, after_backward=None, mark_units=()) -> dict:
    """5 steps; the collectives of each step, and the bytes held after each step's backward and after it."""
    for i, unit in enumerate(mark_units):  # runs after the class's own hooks: "unit i's forward has ended"
        unit.register_forward_hook(lambda *_, i=i: log.mark(f"forward end {i}",
                                                            held=storage_bytes(model.parameters())))
    record = {"steps": [], "grad_bytes": [], "param_bytes": [], "state_bytes": []}
    parameters = list(model.parameters()) + list(getattr(optimizer, "shards", {}).values())
    for step in range(STEPS):
        inputs, targets = batch(width, rank, step, device)
        loss = (model(inputs).sum(dim=-1) - targets).pow(2).mean()
        loss.backward()
        log.mark("backward end")
        if after_backward:
            after_backward()
        record["grad_bytes"].append(storage_bytes(p.grad for p in parameters))
        optimizer.step()
        record["steps"].append(log.take())
        record["param_bytes"].append(storage_bytes(parameters))
        local = getattr(optimizer, "optimizer", optimizer)
        record["state_bytes"].append(storage_bytes(v for s in local.state.values() for k, v in s.items()
                                                   if k in ("exp_avg", "exp_avg_sq")))
        optimizer.zero_grad()
    return record


def gathered(shard: torch.Tensor, numel: int) -> torch.Tensor:
    full = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype, device=shard.device)
    dist.all_gather_single(full, shard.detach().contiguous())
    return full[:numel]


def run_model(name: str, stage: str, cls, rank: int, device: torch.device) -> dict:
    reference, _, width = build_model(name)
    ddp = DDP(reference.to(device), bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(None, allreduce_hook)  # torch's default hook: one dist.all_reduce per bucket
    out = {"ddp": train(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), width, device, rank)}
    model, units, _ = build_model(name)
    model = model.to(device)
    if stage == "bucketed":
        model = cls(model, bucket_cap_mb=CAP_MB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        out["impl"] = train(model, optimizer, width, device, rank, model.finish_gradient_synchronization)
    else:
        optimizer = (cls(model, units, torch.optim.AdamW, lr=LR) if stage == "zero3"
                     else cls(model.parameters(), torch.optim.AdamW, lr=LR))
        out["impl"] = train(model, optimizer, width, device, rank, mark_units=units if stage == "zero3" else ())
    names = {p: n for n, p in reference.named_parameters()}
    full = {names[q]: p.detach() for p, q in zip(model.parameters(), reference.parameters(), strict=True)}
    out["shards"] = {}
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        shard = getattr(optimizer, "shards", {}).get(p)
        if shard is not None:
            out["shards"][names[q]] = {"numel": p.numel(), "values": shard.detach().cpu().tolist()}
            if stage == "zero3":  # the full parameter is freed: gather it from the shards (not counted)
                full[names[q]] = gathered(shard, p.numel()).view_as(q)
    out["max_diff"] = max(float((full[names[q]] - q.detach()).abs().max()) for q in reference.parameters())
    out["reference"] = {names[q]: q.detach().reshape(-1).cpu().tolist() for q in reference.parameters()}
    out["units"] = [[p.numel() for p in unit.parameters()] for unit in units]
    out["numels"] = [p.numel() for p in reference.parameters()]
    if stage == "zero3" and name != "tied":  # FSDP2 cannot shard one weight into two units
        out["fsdp"] = run_fully_shard(name, rank, device)
        fsdp_params = [torch.tensor(values) for values in out["fsdp"].pop("params")]
        out["fsdp_diff"] = max(float((full[names[q]].reshape(-1).cpu() - values).abs().max())
                               for q, values in zip(reference.parameters(), fsdp_params, strict=True))
    return out


def run_fully_shard(name: str, rank: int, device: torch.device) -> dict:
    model, units, width = build_model(name)
    model = model.to(device)
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    record = train(model, torch.optim.AdamW(model.parameters(), lr=LR), width, device, rank)
    record["params"] = [p.full_tensor().reshape(-1).cpu().tolist() for p in model.parameters()]
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", default="solution")
    parser.add_argument("--stage", choices=sorted(CLASSES), default="zero3")
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    cls = load_class(args.impl, args.stage)
    results = {}
    for name in MODELS:
        results[name] = run_model(name, args.stage, cls, rank, device)
    result(stage=args.stage, world_size=world_size, cap_mb=CAP_MB, models=results)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
