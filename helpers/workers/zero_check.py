"""Lesson 09's check harness: train the learner's class beside torch's own on every rank, and hand back what it did.

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_check.py --check zero3 notebooks/my_zero3.py

--check STAGE FILE: the class to check, from FILE (bucketed: BucketedDDP, zero1: Zero1, zero2: Zero2, zero3: Zero3).
Repeat it to check several classes one after another in this one launch, beside one shared run of torch's
DistributedDataParallel (the course's tests grade many classes this way; a notebook's check passes one).
For each of three models (helpers.kit.zero.build_model: mlp, odd = no tensor divides by 2, tied = one weight shared)
it trains 5 AdamW steps on each rank's own data, step 3 with two backward passes before the optimizer step (gradient
accumulation), with the class and with DDP (for zero3 also with FSDP2's fully_shard), from the same weights.
Each rank hands back, per class and model: the shards and parameter shapes right after the constructor; the
collectives the constructor and each step issued, and when each async one was first waited for
(helpers.kit.zero.CommLog); markers at the end of backward and at the start and end of each unit's forward and the
start of its backward, with the bytes of full parameters held at the end of backward, at the end of each unit's
forward and at the start of each unit's backward; the bytes its tensors hold; the other tensors reachable from the
class and the model (helpers.kit.zero.other_tensors), and any storage behind the class's own tensors that holds
more than they use (helpers.kit.zero.hidden_storage); and after every step how far its gradients (or gradient shards),
shards and parameters are from DDP's. helpers/lessons/zero.py decides. Works with one process.

While the class trains, the output of every async_op=True all-reduce, reduce-scatter or all-gather it issues (the list
forms too) holds NaN, except any part that is also its input, until the class waits for it (CommLog.hold_outputs), so
that a buffer read before its wait() reads NaN on every run, not a timing-dependent mix; the markers record a unit
that starts with NaN in a parameter. A class whose values hold NaN on one model is not run on the next ones (the ranks
agree on it): NaN says what is wrong, and the tied model would crash on it. A unit about to run with a freed parameter
stops the launch with a sentence that names the unit and the parameter (StoppedByTheCheck), where torch would stop
inside its own code with an out-of-bounds storage error. A unit about to run with a parameter whose shape is not the
model's (`p.data = torch.empty(0)` in place of free_storage) ends that class's training there (ShapeChanged, recorded
as "stopped"; the launch goes on), where torch would stop the launch with a size mismatch.
"""
import argparse
import functools
import importlib.util
import math
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.tensors import storage_bytes
from helpers.kit.zero import ACCUMULATE_STEP, STEPS, CommLog, build_model, hidden_storage, other_tensors, padded_flat

CLASSES = {"bucketed": "BucketedDDP", "zero1": "Zero1", "zero2": "Zero2", "zero3": "Zero3"}
MODELS, LR, CAP_MB = ("mlp", "odd", "tied"), 1e-2, 0.01  # cap 10 KiB: the mlp makes 2 buckets
TOLERANCE = 1e-6  # as helpers/lessons/zero.py's
log = CommLog().install()  # before the learner's file is loaded, so `from torch.distributed import ...` is seen


class StoppedByTheCheck(RuntimeError):
    """The harness stops a class that is about to compute with a freed parameter, and says what the class did."""


class ShapeChanged(RuntimeError):
    """A unit is about to run with a parameter whose shape is not the model's (`p.data = torch.empty(0)` in place of
    free_storage): check() ends this class's training there and hands back where, for helpers/lessons/zero.py to say,
    where the model would have stopped the launch inside torch with a size mismatch."""


def load_class(stage: str, file: str):
    path = Path(file).resolve()
    for neighbour in path.parent.glob("*.py"):  # my_zero2.py imports my_zero1.py: the one beside it, not an earlier
        loaded = sys.modules.get(neighbour.stem)
        if loaded is not None and getattr(loaded, "__file__", None) != str(neighbour):
            del sys.modules[neighbour.stem]
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return getattr(module, CLASSES[stage])


def batch(width: int, rank: int, step: int, micro: int, device: torch.device):
    generator = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)  # each rank its own data
    return torch.randn(8, width, generator=generator).to(device), torch.randn(8, generator=generator).to(device)


def train(model, optimizer, width, device, rank, after_backward=None, mark_units=(), after_step=None,
          known=None, watch=None) -> dict:
    """5 steps (step ACCUMULATE_STEP with two backward passes); the collectives of each step, the bytes held after each
    step's backward and after it. after_step(step): called after the optimizer step, before zero_grad. known(): the
    tensors the class may hold, named; when given, the other tensors reachable from it and the model are counted, and
    the storages behind the known ones. watch: {"model": its name, "names": parameter -> name} for the learner's
    class: each unit's parameters are looked at when its forward or backward starts (see look)."""
    at = {"step": 0}
    world_size = dist.get_world_size()

    def look(i: int, when: str) -> dict:
        """A freed parameter stops the check (StoppedByTheCheck); NaN in one is recorded in the marker."""
        if not watch:
            return {}
        params = list(mark_units[i].parameters())
        for p in params:
            name, want = watch["names"][p], watch["shapes"][watch["names"][p]]
            if list(p.shape) != want:
                raise ShapeChanged({"when": f"at step {at['step']}, when unit {i}'s {when} was about to run,",
                                    "name": name, "shape": list(p.shape)})
        freed = [watch["names"][p] for p in params if p.numel() and not p.untyped_storage().size()]
        if freed:
            shared = [(name, j) for name in freed for j, other in enumerate(mark_units) if j != i
                      and any(watch["names"][q] == name for q in other.parameters())]
            tied = "".join(f" ({name} is also unit {j}'s: one tied weight, so freeing unit {j} freed it)"
                           for name, j in shared[:1])
            hook = "forward pre-hook" if when == "forward" else "backward pre-hook"
            raise StoppedByTheCheck(
                f"model {watch['model']!r}, step {at['step']}: unit {i}'s {when} was about to run with "
                f"{', '.join(freed)} freed (0 bytes of storage){tied}: when your class's {hook} for unit {i} "
                "returned, that parameter had no memory; the hook must alloc_storage(p) and copy the gathered values "
                "into it after waiting for its all-gather.")
        with torch.no_grad():
            nan = [watch["names"][p] for p in params if p.numel() and bool(torch.isnan(p).any())]
        return {"nan": nan} if nan else {}

    for i, unit in enumerate(mark_units):  # run after the class's own hooks, registered before these
        unit.register_forward_pre_hook(lambda *_, i=i: log.mark(f"forward start {i}", **look(i, "forward")))
        unit.register_forward_hook(lambda *_, i=i: log.mark(f"forward end {i}",
                                                            held=storage_bytes(model.parameters())))
        unit.register_full_backward_pre_hook(lambda *_, i=i: log.mark(f"backward start {i}", **look(i, "backward"),
                                                                       held=storage_bytes(model.parameters())))
    record = {"steps": [], "grad_bytes": [], "param_bytes": [], "state_bytes": [], "other": []}
    parameters = list(model.parameters()) + list(getattr(optimizer, "shards", {}).values())
    local = getattr(optimizer, "optimizer", optimizer)
    roots = {type(optimizer).__name__: optimizer, "the model": model}

    for step in range(STEPS):
        at["step"] = step
        for micro in range(2 if step == ACCUMULATE_STEP else 1):
            inputs, targets = batch(width, rank, step, micro, device)
            loss = (model(inputs).sum(dim=-1) - targets).pow(2).mean()
            loss.backward()
            log.mark("backward end", held=storage_bytes(model.parameters()))
            if after_backward:
                after_backward()
        if known:
            named = known()
            record["other"].append({"when": "when backward ended", "hidden": hidden_storage(named, world_size),
                                    **other_tensors([t for _, t in named], **roots)})
        record["grad_bytes"].append(storage_bytes(p.grad for p in parameters))
        optimizer.step()
        if after_step:
            after_step(step)
        if known:
            named = known()
            record["other"].append({"when": "after step()", "hidden": hidden_storage(named, world_size),
                                    **other_tensors([t for _, t in named], **roots)})
        record["steps"].append(log.take())
        record["param_bytes"].append(storage_bytes(parameters))
        record["state_bytes"].append(storage_bytes(v for s in local.state.values() for k, v in s.items()
                                                   if k in ("exp_avg", "exp_avg_sq")))
        optimizer.zero_grad()
    return record


def distance(got: torch.Tensor | None, want: torch.Tensor) -> dict:
    """How far a tensor (a gradient, a shard) is from DDP's: max abs difference (NaN when it holds NaN), DDP's max
    abs, its number of values (None when there is none), the scale factor that best maps DDP's onto it (2.0 on 2 ranks
    when a sum was not divided by the world size, 0.5 when it was divided twice), and how far it is from DDP's times
    that factor ("fit")."""
    scale = float(want.abs().max()) if want.numel() else 0.0
    if got is None or got.numel() != want.numel():
        return {"diff": None, "scale": scale, "ratio": None, "fit": None,
                "numel": None if got is None else got.numel()}
    got, want = got.detach().cpu().double().reshape(-1), want.detach().cpu().double().reshape(-1)
    ratio = (got * want).sum() / (want * want).sum().clamp_min(1e-30)
    return {"diff": float((got - want).abs().max()) if got.numel() else 0.0, "scale": scale, "numel": got.numel(),
            "ratio": float(ratio), "fit": float((got - ratio * want).abs().max()) if got.numel() else 0.0}


def worst(a: float | None, b: float | None) -> float | None:
    """The larger difference; None if either is None, NaN if either is NaN (max() would drop a NaN)."""
    if a is None or b is None:
        return None
    return b if math.isnan(b) or b > a else a


def anywhere(flag: bool, device: torch.device) -> bool:
    """True on every rank when it is true on any (the harness's own all-reduce, not logged)."""
    value = torch.tensor([float(flag)], device=device)
    before = len(log.events)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    del log.events[before:]
    return bool(value.item())


def gathered(shard: torch.Tensor, numel: int) -> torch.Tensor:
    """The full parameter from every rank's shard; the harness's own all-gather is not logged."""
    full = torch.empty(dist.get_world_size() * shard.numel(), dtype=shard.dtype, device=shard.device)
    before = len(log.events)
    dist.all_gather_single(full, shard.detach().contiguous())
    del log.events[before:]
    return full[:numel]


def baseline(name: str, rank: int, device: torch.device, with_fsdp: bool) -> dict:
    """torch's DDP (and FSDP2) on one model: what every class is compared with, run once per launch."""
    reference, units, width = build_model(name)
    names = [n for n, _ in reference.named_parameters()]
    initial = {n: q.detach().clone() for n, q in reference.named_parameters()}
    ddp = DDP(reference.to(device), bucket_cap_mb=CAP_MB)
    ddp.register_comm_hook(None, allreduce_hook)  # torch's default hook: one dist.all_reduce per bucket
    construction = log.take()  # DDP's constructor broadcasts rank 0's parameters (_sync_module_states)
    grads, params = [], []

    def keep(step: int) -> None:  # the gradients the optimizer has just used (before zero_grad), and the result
        grads.append({n: q.grad.detach().clone() for n, q in zip(names, reference.parameters(), strict=True)})
        params.append({n: q.detach().clone() for n, q in zip(names, reference.parameters(), strict=True)})

    out = {"ddp": train(ddp, torch.optim.AdamW(ddp.parameters(), lr=LR), width, device, rank, after_step=keep),
           "names": names, "numels": [q.numel() for q in reference.parameters()],
           "reference_shapes": {n: list(q.shape) for n, q in reference.named_parameters()},
           "units": [[p.numel() for p in unit.parameters()] for unit in units],
           "initial": {n: t.reshape(-1).tolist() for n, t in initial.items()}}
    out["ddp"]["construction"] = construction
    if with_fsdp and name != "tied":  # FSDP2 cannot shard one weight into two units
        out["fsdp"] = run_fully_shard(name, rank, device)
    return {"report": out, "grads": grads, "params": params}


def run_fully_shard(name: str, rank: int, device: torch.device) -> dict:
    model, units, width = build_model(name)
    model = model.to(device)
    for unit in units:
        fully_shard(unit)
    fully_shard(model)
    with warnings.catch_warnings():  # a unit returns a view; no in-place op on it follows in train()
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        record = train(model, torch.optim.AdamW(model.parameters(), lr=LR), width, device, rank, mark_units=units)
    record["params"] = [p.full_tensor().detach().reshape(-1).cpu() for p in model.parameters()]
    return record


def check(name: str, stage: str, cls, rank: int, device: torch.device, base: dict) -> dict:
    """Build the class on a fresh copy of the model, train it, and compare it with DDP after every step."""
    world_size = dist.get_world_size()
    model, units, width = build_model(name)
    model = model.to(device)
    names = base["report"]["names"]
    if stage == "bucketed":
        model = cls(model, bucket_cap_mb=CAP_MB)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    else:
        optimizer = (cls(model, units, torch.optim.AdamW, lr=LR) if stage == "zero3"
                     else cls(model.parameters(), torch.optim.AdamW, lr=LR))
    out = {"construction": log.take()}  # the collectives of the constructor, not of step 0
    params = list(model.parameters())
    shards = getattr(optimizer, "shards", None) or {}
    out["has_shards"] = hasattr(optimizer, "shards")
    out["shards"] = {n: shards[p].detach().reshape(-1).cpu().tolist() for n, p in zip(names, params, strict=True)
                     if p in shards}
    out["shapes"] = {n: list(p.shape) for n, p in zip(names, params, strict=True)}
    out["values"] = []

    def chunk(tensor: torch.Tensor) -> torch.Tensor:  # this rank's part of DDP's tensor, under the lesson's rule
        return padded_flat(tensor, world_size).chunk(world_size)[rank]

    initial = {n: torch.tensor(base["report"]["initial"][n]) for n in names}

    def placed(p: torch.Tensor, n: str, step: int) -> dict:
        """Where a wrong parameter's values come from: its values before this step's update, or DDP's updated values
        read from another offset of the gathered, padded buffer (the first p.numel() values are the parameter)."""
        values = p.detach().cpu().double().reshape(-1)
        before = base["params"][step - 1][n] if step else initial[n]
        if distance(values, before)["diff"] <= TOLERANCE:
            return {"before": True}
        padded = padded_flat(base["params"][step][n], world_size)
        for offset in range(1, padded.numel() - values.numel() + 1):
            if distance(values, padded[offset:offset + values.numel()])["diff"] <= TOLERANCE:
                return {"offset": offset, "padded": padded.numel()}
        return {}

    def compare(step: int) -> None:  # the gradients the optimizer used in this step, and what it made of them
        want_grads, want_params = base["grads"][step], base["params"][step]
        row = {"grads": {}, "shards": 0.0 if shards else None, "params": None if stage == "zero3" else 0.0,
               "placed": {}}
        for n, p in zip(names, params, strict=True):
            shard = shards.get(p)
            if stage == "bucketed":
                row["grads"][n] = distance(p.grad, want_grads[n])
            elif shard is not None:
                row["grads"][n] = distance(shard.grad, chunk(want_grads[n]))
                row["shards"] = worst(row["shards"], distance(shard, chunk(want_params[n]))["diff"])
            if stage != "zero3" and row["params"] is not None:
                got = distance(p, want_params[n])["diff"]
                row["params"] = worst(row["params"], got)
                if got is not None and not got <= TOLERANCE:
                    row["placed"][n] = placed(p, n, step)
        out["values"].append(row)

    def known() -> list[tuple[str, torch.Tensor]]:  # what the class may hold: parameters, gradients, shards, Adam state
        name = dict(zip(params, names, strict=True))
        named = [(n, p) for n, p in zip(names, params, strict=True)]
        named += [(f"the shard of {name[p]}", shard) for p, shard in shards.items() if p in name]
        named += [(f"the gradient of {n}", t.grad) for n, t in named]
        of = {id(shard): what for what, shard in named if what.startswith("the shard of ")}
        local = getattr(optimizer, "optimizer", optimizer)
        return named + [(f"the {key} of {of.get(id(t), 'a tensor the optimizer updates')}", v)
                        for t, state in local.state.items() for key, v in state.items() if torch.is_tensor(v)]

    log.hold_outputs = True  # the class's async outputs hold NaN until it waits (helpers.kit.zero.CommLog)
    try:
        if stage == "bucketed":
            out["impl"] = train(model, optimizer, width, device, rank, model.finish_gradient_synchronization,
                                after_step=compare)
        else:
            watch = {"model": name, "names": dict(zip(params, names, strict=True)),
                     "shapes": base["report"]["reference_shapes"]}
            out["impl"] = train(model, optimizer, width, device, rank, mark_units=units if stage == "zero3" else (),
                                after_step=compare, known=known, watch=watch)
    except ShapeChanged as stop:  # every rank runs the same code, so every rank stops here (the next class goes on)
        out["stopped"] = stop.args[0]
        log.take()  # this step's calls, some never waited for: not the next class's
    finally:
        log.hold_outputs = False
    out["shapes_after"] = {n: list(p.shape) for n, p in zip(names, params, strict=True)}
    if "stopped" in out:  # helpers/lessons/zero.py names the shape before it reads anything training would have left
        out["nan"] = False
        return out
    final = base["params"][-1]
    if stage == "zero3" and len(shards) == len(params):  # the full parameters are freed: gather them (not counted)
        full = {n: gathered(shards[p], final[n].numel()).view_as(final[n]) for n, p in zip(names, params, strict=True)}
    else:
        full = {n: p.detach() for n, p in zip(names, params, strict=True)}
    diffs = [distance(full[n], final[n])["diff"] for n in names]
    out["max_diff"] = None if None in diffs else functools.reduce(worst, diffs)
    values = [value for row in out["values"] for value in
              [row["shards"], row["params"], *(g["diff"] for g in row["grads"].values())] if value is not None]
    out["nan"] = any(math.isnan(value) for value in [*values, out["max_diff"] or 0.0]) or any(
        "nan" in e for events in out["impl"]["steps"] for e in events)
    if "fsdp" in base["report"] and stage == "zero3":
        out["fsdp_diff"] = max(float((full[n].reshape(-1).cpu() - values).abs().max())
                               for n, values in zip(names, base["report"]["fsdp"]["params"], strict=True))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", nargs=2, action="append", metavar=("STAGE", "FILE"), required=True,
                        help=f"a stage ({', '.join(CLASSES)}) and the file with its class; repeat for more")
    args = parser.parse_args()
    for stage, _ in args.check:
        if stage not in CLASSES:
            parser.error(f"unknown stage {stage!r}: choose one of {', '.join(CLASSES)}")
    rank, world_size, device = init_distributed()
    with_fsdp = any(stage == "zero3" for stage, _ in args.check)
    bases = {name: baseline(name, rank, device, with_fsdp) for name in MODELS}
    checks = []
    for stage, file in args.check:
        cls = load_class(stage, file)
        models = {}
        for name in MODELS:
            models[name] = check(name, stage, cls, rank, device, bases[name])
            # NaN or a changed shape names the mistake; the next models repeat it, or crash
            if anywhere(models[name]["nan"] or "stopped" in models[name], device):
                break
        checks.append({"stage": stage, "models": models})
    for base in bases.values():
        base["report"].get("fsdp", {}).pop("params", None)
    result(world_size=world_size, cap_mb=CAP_MB, baselines={n: b["report"] for n, b in bases.items()}, checks=checks)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
