"""Lesson 09's check harness: run one step of the lesson (ours or the learner's) beside torch's own, on every rank.

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_check.py --impl solution --stage zero3

--impl: a file with the learner's class (notebooks/my_zero3.py, ...) or `solution` (zero_solution.py).
--stage: bucketed (BucketedDDP), zero1, zero2 or zero3. For each of three models (helpers.kit.zero.build_model:
mlp, odd = no tensor divides by 2, tied = one weight shared) it trains 5 AdamW steps on each rank's own data,
with the class under test and with torch's DistributedDataParallel (and, for zero3, FSDP2's fully_shard),
from the same weights. Each rank hands back: how far its gradients after step 0 are from DDP's averaged ones,
its parameters and shards, the bytes its tensors hold (read from the tensors), for ZeRO the bytes of every other
tensor reachable from the class's object and the model (reachable_tensors), the collectives issued while the
class was built and in each step (helpers.kit.zero.CommLog; torch's DDP is counted through its default comm hook,
which calls dist.all_reduce), and markers for the end of backward, the start and end of each unit's forward and the
start of each unit's backward. helpers/lessons/zero.py reads the results and decides. Works with one process.
"""
import argparse
import functools
import importlib.util
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.zero import CommLog, build_model, padded_flat, storage_bytes, storage_key

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


def reachable_tensors(*roots) -> list[torch.Tensor]:
    """Every tensor reachable from `roots` (the class's object, the model) through attributes of objects, modules
    and tensors (a buffer hung on a parameter or a shard, `p._full = ...`; torch keeps only hook dicts there),
    dicts, lists, tuples and sets, and through functions kept there (hooks included): a function's closure cells and
    default arguments, a bound method's object, a functools.partial's arguments. Not through a function's globals,
    classes, modules or C++ objects: a tensor kept in a module-level global or a pending collective is not seen."""
    seen, found, todo = set(), [], list(roots)
    while todo:
        obj = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(obj)
            todo += list(getattr(obj, "__dict__", {}).values())  # the tensor's own Python attributes
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    todo.append(cell.cell_contents)
                except ValueError:  # a cell not yet filled
                    pass
            todo += list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        elif isinstance(obj, types.MethodType):
            todo += [obj.__func__, obj.__self__]
        elif isinstance(obj, functools.partial):
            todo += [obj.func, *obj.args, *obj.keywords.values()]
        elif isinstance(obj, dict):
            todo += list(obj.keys()) + list(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += list(obj)
        elif hasattr(obj, "__dict__") and not isinstance(obj, (type, types.ModuleType)):
            todo += list(vars(obj).values())
    return found


def other_tensors(roots, known) -> dict:
    """Bytes of the tensor storages reachable from `roots` that are none of `known` (the class's parameters,
    gradients, shards, their gradients, optimizer state): their count, total bytes, and the shape of the largest."""
    skip = {storage_key(t) for t in known if t is not None}
    other = {}
    for tensor in reachable_tensors(*roots):
        key = storage_key(tensor)
        if key not in skip and tensor.untyped_storage().size():
            other[key] = max(other.get(key, (0, ())), (tensor.untyped_storage().size(), tuple(tensor.shape)))
    largest = max(other.values(), default=(0, ()))
    return {"tensors": len(other), "bytes": sum(size for size, _ in other.values()), "largest": list(largest[1])}


def train(model, optimizer, width, device, rank, after_backward=None, mark_units=(), grads=None,
          count_others: bool = False) -> dict:
    """5 steps; the collectives of each step, and the bytes held after each step's backward and after it.

    grads: a dict that receives, after step 0, each parameter's .grad and each shard's .grad (by tensor).
    count_others: count, after backward and after the step, the tensors reachable from the class and the model
    that are none of its parameters, gradients, shards, their gradients or optimizer state (record["other"])."""
    for i, unit in enumerate(mark_units):  # run after the class's own hooks, registered before these
        unit.register_forward_pre_hook(lambda *_, i=i: log.mark(f"forward start {i}"))
        unit.register_forward_hook(lambda *_, i=i: log.mark(f"forward end {i}",
                                                            held=storage_bytes(model.parameters())))
        unit.register_full_backward_pre_hook(lambda *_, i=i: log.mark(f"backward start {i}"))
    record = {"steps": [], "grad_bytes": [], "param_bytes": [], "state_bytes": [], "other": []}
    parameters = list(model.parameters()) + list(getattr(optimizer, "shards", {}).values())
    local = getattr(optimizer, "optimizer", optimizer)

    def others() -> dict:  # everything else the class and the model hold in tensors, bytes
        known = parameters + [t.grad for t in parameters] + [v for s in local.state.values() for v in s.values()
                                                            if torch.is_tensor(v)]
        return other_tensors((optimizer, model), known)

    for step in range(STEPS):
        inputs, targets = batch(width, rank, step, device)
        loss = (model(inputs).sum(dim=-1) - targets).pow(2).mean()
        loss.backward()
        log.mark("backward end", held=storage_bytes(model.parameters()))
        if count_others:
            record["other"].append({"when": "when backward ended", **others()})
        if after_backward:
            after_backward()
        record["grad_bytes"].append(storage_bytes(p.grad for p in parameters))
        optimizer.step()
        if step == 0 and grads is not None:  # the gradients the optimizer has just used (before zero_grad)
            grads.update({t: t.grad.detach().clone() for t in parameters if t.grad is not None})
        if count_others:
            record["other"].append({"when": "after step()", **others()})
        record["steps"].append(log.take())
        record["param_bytes"].append(storage_bytes(parameters))
        record["state_bytes"].append(storage_bytes(v for s in local.state.values() for k, v in s.items()
                                                   if k in ("exp_avg", "exp_avg_sq")))
        optimizer.zero_grad()
    return record


def gathered(shard: torch.Tensor, numel: int) -> torch.Tensor:
    """The full parameter from every rank's shard; the harness's own all-gather is not logged."""
    full = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype, device=shard.device)
    before = len(log.events)
    dist.all_gather_single(full, shard.detach().contiguous())
    del log.events[before:]
    return full[:numel]


def gradient_distance(got: torch.Tensor | None, want: torch.Tensor) -> dict:
    """How far a gradient (or shard of one) is from DDP's: max abs difference, DDP's max abs, and the scale
    factor that best maps DDP's onto it (2.0 on 2 ranks when the sum was not divided by the world size)."""
    if got is None or got.shape != want.shape:
        return {"diff": None, "scale": float(want.abs().max()), "ratio": None}
    got, want = got.detach().cpu().double(), want.detach().cpu().double()
    return {"diff": float((got - want).abs().max()), "scale": float(want.abs().max()),
            "ratio": float((got * want).sum() / (want * want).sum().clamp_min(1e-30))}


def run_model(name: str, stage: str, cls, rank: int, device: torch.device) -> dict:
    world_size = dist.get_world_size()
    reference, _, width = build_model(name)
    ddp = DDP(reference.to(device), bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(None, allreduce_hook)  # torch's default hook: one dist.all_reduce per bucket
    out_construction = log.take()  # DDP's constructor broadcasts rank 0's parameters (_sync_module_states)
    ddp_grads, impl_grads = {}, {}
    out = {"ddp": train(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), width, device, rank, grads=ddp_grads)}
    out["ddp"]["construction"] = out_construction
    model, units, _ = build_model(name)
    model = model.to(device)
    if stage == "bucketed":
        model = cls(model, bucket_cap_mb=CAP_MB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
        out["construction"] = log.take()  # the collectives of the constructor, not of step 0
        out["impl"] = train(model, optimizer, width, device, rank, model.finish_gradient_synchronization,
                            grads=impl_grads)
    else:
        optimizer = (cls(model, units, torch.optim.AdamW, lr=LR) if stage == "zero3"
                     else cls(model.parameters(), torch.optim.AdamW, lr=LR))
        out["construction"] = log.take()  # the collectives of the constructor, not of step 0
        out["impl"] = train(model, optimizer, width, device, rank, mark_units=units if stage == "zero3" else (),
                            grads=impl_grads, count_others=True)
    names = {p: n for n, p in reference.named_parameters()}
    full = {names[q]: p.detach() for p, q in zip(model.parameters(), reference.parameters(), strict=True)}
    out["shards"], out["grads"] = {}, {}  # grads: step 0's gradient (bucketed) or gradient shard (ZeRO) vs DDP's
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        shard = getattr(optimizer, "shards", {}).get(p)
        if shard is not None:
            out["shards"][names[q]] = {"numel": p.numel(), "values": shard.detach().cpu().tolist()}
            want = padded_flat(ddp_grads[q], world_size).chunk(world_size)[rank]
            out["grads"][names[q]] = gradient_distance(impl_grads.get(shard), want)
            if stage == "zero3":  # the full parameter is freed: gather it from the shards (not counted)
                full[names[q]] = gathered(shard, p.numel()).view_as(q)
        elif stage == "bucketed":
            out["grads"][names[q]] = gradient_distance(impl_grads.get(p), ddp_grads[q])
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
