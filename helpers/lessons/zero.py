"""Lesson 09 (build ZeRO yourself): the checks of the four steps, the formulas they compare with, and pictures.

    from helpers.lessons.zero import check_step, expected, traffic, holdings_figure
    checked = check_step("zero2", "my_zero2.py")   # prints "Correct: ..." or "Not yet: ..."; bool(checked)

check_step launches helpers/workers/zero_check.py on 2 ranks; check_results decides from what every rank
handed back. Every number it compares with comes from a formula in this file or from torch's DDP in the same
run (gradients after step 0, parameters after 5 steps, bucket sizes), and every measured number from the run
(tensors each rank held, collectives each rank issued through torch.distributed's functions).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from helpers import LaunchTimeout, WorkerFailed, launch
from helpers.kit import WORKERS
from helpers.kit.zero import shard_size
from helpers.lessons.checks import correct, not_yet, not_yet_crashed

STAGES = ("bucketed", "zero1", "zero2", "zero3")
TOLERANCE = 1e-6
VOLUME = {"all_reduce": 2, "reduce_scatter_single": 1, "reduce_scatter_tensor": 1, "all_gather_single": 1,
          "all_gather_into_tensor": 1, "broadcast": 1, "all_gather": 1, "reduce_scatter": 1}


def expected(numels: list[int], world_size: int) -> dict[str, int]:
    """Bytes one rank should hold under the lesson's sharding (fp32, Adam's two moments), and the padding."""
    shard = sum(shard_size(n, world_size) for n in numels)
    return {"params": sum(numels), "shard": shard, "padding": shard * world_size - sum(numels),
            "adam_shard_bytes": 8 * shard, "grad_shard_bytes": 4 * shard, "param_shard_bytes": 4 * shard}


def traffic(events: list[dict]) -> dict[str, int]:
    """Calls and bytes per operation in one step's events, and the volume in the ZeRO paper's units: the bytes
    handed to each collective (the full tensor), weighted by the paper's convention: an all-reduce of B bytes
    counts 2B (a reduce-scatter plus an all-gather), every other collective B. Not bytes measured on a wire."""
    out: dict[str, int] = {"volume": 0}
    for event in events:
        if event["op"] != "mark":
            out[f"{event['op']} calls"] = out.get(f"{event['op']} calls", 0) + 1
            out[f"{event['op']} bytes"] = out.get(f"{event['op']} bytes", 0) + event["bytes"]
            out["volume"] += VOLUME.get(event["op"], 1) * event["bytes"]
    return out


def _bytes_of(events: list[dict], prefix: str) -> int:
    return sum(e["bytes"] for e in events if e["op"].startswith(prefix))


def _calls_of(events: list[dict], prefix: str) -> int:
    return sum(1 for e in events if e["op"].startswith(prefix))


def _gradient_problem(stage: str, model: dict, rank: int, world_size: int) -> str | None:
    """Step 0's gradient (bucketed: each .grad; ZeRO: each shard's .grad) against DDP's averaged one."""
    for pname, got in model["grads"].items():
        if got["diff"] is not None and got["diff"] <= TOLERANCE * max(1.0, got["scale"]):
            continue
        what = "the gradient" if stage == "bucketed" else "the gradient shard"
        if got["ratio"] is not None and abs(got["ratio"] - world_size) < 1e-3:  # catches a sum not divided by N
            return (f"after step 0's backward {what} of {pname} is {world_size} times DDP's averaged gradient: "
                    "divide the summed gradient by the world size.")
        if stage == "bucketed":  # catches a lost gradient, or one copied back into the wrong parameter
            return (f"after step 0's backward the gradient of {pname} differs from DDP's averaged gradient "
                    f"(max abs difference {got['diff']:.2g}).")
        numel = next(s["numel"] for n, s in model["shards"].items() if n == pname)
        size = shard_size(numel, world_size)  # catches a shard taken from the wrong place, a wrong scale
        return (f"after step 0's backward {what} of {pname} should be values [{rank * size}, {(rank + 1) * size}) "
                f"of DDP's averaged gradient, flattened and zero-padded to {size * world_size}; "
                + ("it has no gradient." if got["diff"] is None
                   else f"it differs by up to {got['diff']:.2g}."))
    return None


def _first_problem(stage: str, ranks: dict[int, dict]) -> str | None:
    """The first thing that is wrong, as the sentence after "Not yet: ", or None."""
    for rank, got in sorted(ranks.items()):
        world_size = got["world_size"]
        for name, model in got["models"].items():
            where = f"rank {rank}, model '{name}'"
            problem = _construction_problem(stage, model) or _gradient_problem(stage, model, rank, world_size)
            if problem:
                return f"{where}: {problem}"
            if model["max_diff"] > TOLERANCE:  # catches a lost gradient, a stale shard, an update not gathered
                return (f"{where}: after 5 AdamW steps the parameters differ from torch's DDP by "
                        f"{model['max_diff']:.2g} (more than {TOLERANCE:g}).")
            problem = (_bucket_problem(model, got["cap_mb"]) if stage == "bucketed"
                       else _zero_problem(stage, model, rank, world_size))
            if problem:
                return f"{where}: {problem}"
    return None


BROADCASTS = ("broadcast", "_broadcast_coalesced")  # what DDP's constructor issues (_sync_module_states)


def _construction_problem(stage: str, model: dict) -> str | None:
    """The constructor's collectives, logged apart from step 0: a broadcast of rank 0's state is allowed (DDP's
    constructor does that), anything else is not part of the plan."""
    ops = sorted({e["op"] for e in model["construction"]} - set(BROADCASTS))
    if ops:  # catches a constructor that all-reduces or gathers (the parameters start equal on every rank)
        ddp = sorted({e["op"] for e in model["ddp"]["construction"]})
        return (f"building the {stage} class issued {ops}; a constructor may broadcast rank 0's parameters (torch's "
                f"DDP constructor issued {ddp} in the same run), nothing else.")
    return None


def _bucket_problem(model: dict, cap_mb: float) -> str | None:
    # the plan: the buckets torch's DDP all-reduced in the same run, in its last step (after its bucket rebuild)
    plan = [e["bytes"] for e in model["ddp"]["steps"][-1] if e["op"] == "all_reduce"]
    ddp_ops = sorted({e["op"] for events in model["ddp"]["steps"] for e in events if e["op"] != "mark"})
    for step, events in enumerate(model["impl"]["steps"]):
        calls = [e for e in events if e["op"] != "mark"]
        sizes = [e["bytes"] for e in calls if e["op"] == "all_reduce"]
        if len(calls) != len(sizes):  # catches a broadcast or reduce-scatter where an all-reduce belongs
            return (f"step {step} issued {sorted({e['op'] for e in calls})}; torch's DDP issued {ddp_ops} in its "
                    "steps of the same run (its constructor's broadcast is logged apart).")
        if sizes != plan:  # catches one all-reduce per parameter, a bucket never closed, the wrong order
            return (f"step {step} all-reduced buckets of {sizes} bytes; the bucket plan (the buckets torch's DDP "
                    f"all-reduced in the same run after its rebuild, cap {cap_mb} MiB, gradients back to front) "
                    f"is {plan}.")
        end = next(i for i, e in enumerate(events) if e.get("label") == "backward end")
        late = [i for i, e in enumerate(events) if e["op"] != "mark" and i > end]
        if late or any(not e["async"] for e in calls):
            return ("the all-reduces must start during backward (async_op=True, from the gradient hooks), "
                    "not after it; wait for them in finish_gradient_synchronization.")
    return None


def _zero_problem(stage: str, model: dict, rank: int, world_size: int) -> str | None:
    for pname, shard in model["shards"].items():  # catches padding in front, floor instead of ceil, rank swap
        n, values = shard["numel"], shard["values"]
        size = shard_size(n, world_size)
        flat = model["reference"][pname] + [0.0] * (size * world_size - n)
        want = flat[rank * size:(rank + 1) * size]
        if len(values) != size or max(abs(a - b) for a, b in zip(values, want, strict=True)) > TOLERANCE:
            return (f"the shard of {pname} ({n} values) should be values [{rank * size}, {(rank + 1) * size}) "
                    f"of the flattened parameter, zero-padded to {size * world_size}; it holds {len(values)} "
                    "other values.")
    if len(model["shards"]) != len(model["numels"]):
        return "`shards` should map every parameter to this rank's shard."
    want = expected(model["numels"], world_size)
    impl = model["impl"]
    held = {"Adam state": (impl["state_bytes"][-1], want["adam_shard_bytes"], "8 bytes x shard")}
    if stage in ("zero2", "zero3"):  # catches a Zero2 that keeps the full gradients too
        held["gradients after backward"] = (impl["grad_bytes"][-1], want["grad_shard_bytes"], "4 bytes x shard")
    if stage == "zero3":  # catches parameters left gathered after the step
        held["parameters after the step"] = (impl["param_bytes"][-1], want["param_shard_bytes"], "4 bytes x shard")
    for what, (got, should, formula) in held.items():
        if got != should:
            return f"it holds {got} bytes of {what}; {formula} = {should} ({want['shard']} values per rank)."
    for step, (backward, after) in enumerate(zip(impl["other"][::2], impl["other"][1::2], strict=True)):
        for other in (backward, after):  # catches gather buffers or full gradients kept on the side
            if other["bytes"]:
                return (f"step {step}, {other['when']}: the class and the model held {other['bytes']} bytes in "
                        f"{other['tensors']} tensor storage(s) that are none of the parameters, gradients, shards, "
                        f"shards' gradients or optimizer state (the largest of shape {other['largest']}); free "
                        "buffers once used.")
    full = 4 * want["shard"] * world_size
    n_params = len(model["numels"])
    gather_calls = 2 * sum(len(unit) for unit in model["units"]) if stage == "zero3" else n_params
    gather_bytes = (2 * sum(4 * shard_size(n, world_size) * world_size for unit in model["units"] for n in unit)
                    if stage == "zero3" else full)
    plan = {"reduce_scatter": (n_params, full, "one per parameter"),
            "all_gather": (gather_calls, gather_bytes,
                           "one per parameter of each unit, in forward and in backward" if stage == "zero3"
                           else "one per parameter")}
    for step, events in enumerate(impl["steps"]):
        end = next(i for i, e in enumerate(events) if e.get("label") == "backward end")
        ops = {e["op"] for e in events if e["op"] != "mark"}
        if "all_reduce" in ops:  # catches a ZeRO that all-reduces the gradients
            return f"step {step} all-reduced; reduce-scatter the gradients instead (each rank needs its shard only)."
        others = sorted(op for op in ops if not op.startswith(("reduce_scatter", "all_gather")))
        if others:  # catches any collective outside the plan (a broadcast of the parameters, ...)
            return f"step {step} issued {others}; the plan is reduce-scatters and all-gathers only."
        for op, (calls, should, rule) in plan.items():  # catches a collective repeated, missing, or of the wrong size
            if (_calls_of(events, op), _bytes_of(events, op)) != (calls, should):
                return (f"step {step} issued {_calls_of(events, op)} {op} calls moving {_bytes_of(events, op)} "
                        f"bytes; the plan is {calls} calls ({rule}) moving {should} bytes.")
        if stage != "zero1" and _bytes_of(events[end:], "reduce_scatter"):  # catches the reduce-scatter left to step()
            return f"step {step} reduce-scattered after backward; do it in the gradient hook, during backward."
        if stage == "zero3":
            if events[end]["held"]:  # catches parameters freed in step() instead of after their reduce-scatter
                return (f"step {step}: when backward ended this rank still held {events[end]['held']} bytes of full "
                        "parameters; free each parameter once its gradient is reduce-scattered (in the gradient "
                        "hook).")
            blocking = sum(1 for e in events if e["op"].startswith("all_gather") and not e["async"])
            if blocking:  # catches a "prefetch" that blocks: issued early, it still overlaps nothing
                return (f"step {step} issued {blocking} all-gathers with async_op=False; start every unit's "
                        "all-gathers with async_op=True and wait for them only when that unit starts, so that the "
                        "prefetched unit's all-gather can overlap this unit's compute.")
            problem = _prefetch_problem(events, model["units"], world_size)
            if problem:
                return f"step {step}: {problem}"
    return None


def _prefetch_problem(events: list[dict], units: list[list[int]], world_size: int) -> str | None:
    """All-gathers issued by each marker: by the start of unit i's forward (a pre-hook registered after the class's)
    and by its end, those of units 0..i+1 exactly; by the start of unit i's backward, those of all units in forward
    and of units i-1..last in backward, exactly. Order of issue: not a measurement of overlap."""
    unit_bytes = [sum(4 * shard_size(n, world_size) * world_size for n in unit) for unit in units]
    full_bytes = [4 * sum(unit) for unit in units]
    last, issued = len(units) - 1, 0
    for event in events:
        if event["op"].startswith("all_gather"):
            issued += event["bytes"]
        label = event.get("label") or ""
        match = re.fullmatch(r"(forward start|forward end|backward start) (\d+)", label)
        if not match:
            continue
        i, where = int(match[2]), match[1].split(" ")[1]
        if match[1].startswith("forward"):
            # catches a unit left gathered after its forward
            if where == "end" and event["held"] > (full_bytes[i + 1] if i < last else 0):
                return (f"after unit {i}'s forward this rank still held {event['held']} bytes of full parameters; "
                        "free each unit after its forward (only the next, prefetched unit may be held).")
            want = sum(unit_bytes[: i + 2])
            if issued < want:  # catches no prefetch, and a prefetch issued only after unit i computed
                return (f"unit {min(i + 1, last)}'s all-gather was not issued by the {where} of unit {i}'s forward "
                        f"(issue it before unit {i} computes, so that it can overlap that compute).")
            if issued > want:  # catches gathering further ahead (every unit at once: the whole model resident)
                return (f"by the {where} of unit {i}'s forward this rank had issued all-gathers of {issued} bytes, "
                        f"more than units 0..{min(i + 1, last)} need ({want}): gather only the next unit ahead.")
        else:
            want = sum(unit_bytes) + sum(unit_bytes[max(i - 1, 0):])
            if issued < want:  # catches a backward without prefetch
                return (f"unit {i - 1}'s all-gather was not issued when unit {i}'s backward started (no backward "
                        "prefetch).")
            if issued > want:  # catches gathering further ahead in backward
                return (f"when unit {i}'s backward started this rank had issued all-gathers of {issued} bytes in "
                        f"this step, more than forward and units {max(i - 1, 0)}..{last} need ({want}).")
    return None


def check_results(stage: str, ranks: dict[int, dict]) -> bool:
    """Decide from the results of zero_check.py (run.results); prints Correct or Not yet."""
    problem = _first_problem(stage, ranks)
    if problem:
        return not_yet(problem)
    mlp = ranks[0]["models"]["mlp"]
    volume = traffic(mlp["impl"]["steps"][-1])["volume"]
    ddp_volume = traffic(mlp["ddp"]["steps"][-1])["volume"]
    what = {"bucketed": "the bucket plan's all-reduces, started during backward",
            "zero1": "Adam state 8 bytes x shard; reduce-scatter + all-gather",
            "zero2": "Adam state and gradients sharded; reduce-scatter during backward",
            "zero3": "parameters, gradients, Adam state sharded; unit i+1's all-gather issued (async_op=True) "
                     "before unit i's forward computes, unit i-1's before unit i's backward"}[stage]
    if stage != "bucketed":
        what += ("; no other tensor in the class or the model after backward or after the step, looked for through "
                 "attributes, containers, tensors' attributes and hooks' closures")
    return correct(f"{stage} equals DDP + AdamW on every rank for mlp, odd and tied ({what}); bytes handed to "
                   f"collectives per step, weighted as the ZeRO paper does, {volume / ddp_volume:.2f}x DDP's for mlp.")


class Checked:
    """What check_step hands back: true when the step passed; `.results` holds every rank's results."""

    def __init__(self, passed: bool, results: dict | None, script: str = "") -> None:
        self.passed, self.results, self.script = passed, results, script

    def __bool__(self) -> bool:
        return self.passed


def check_step(stage: str, script: str | Path, timeout: float = 120, nproc: int = 2,
               keep: dict | None = None) -> Checked:
    """Launch zero_check.py with the class in `script` on `nproc` ranks and decide. Prints Correct or Not yet.

    keep: a dict that receives the run under `stage` when the check passes (a failed check leaves it as it was)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
    try:
        run = launch(WORKERS / "zero_check.py", nproc=nproc, echo=False, timeout=timeout,
                     args=["--impl", str(Path(script).resolve()), "--stage", stage])
    except LaunchTimeout:
        return Checked(not_yet(f"still running after {timeout:g} s: a collective that one rank never joins?"), None)
    except WorkerFailed as error:
        return Checked(not_yet_crashed(error, f"the {stage} check of {Path(script).name}"), None)
    checked = Checked(check_results(stage, run.results), run.results, str(Path(script).resolve()))
    if checked and keep is not None:
        keep[stage] = checked
    return checked


def _passed(checked: Checked | None, stage: str) -> bool:
    if not checked:
        print(f"(no results yet: the {stage} check has not passed)")
        return False
    return True


def memory_table(checked: Checked | None, stage: str) -> None:
    """Bytes each rank held, read from its tensors, beside the formula (4 bytes per value, Adam: 8)."""
    if not _passed(checked, stage):
        return
    print(f"{'model':<6}{'rank':>5}{'params':>8}{'shard':>7}{'pad':>5} | {'Adam state':>11}{'formula':>9} |"
          f" {'grads':>7}{'formula':>9} | {'params':>7}{'formula':>9}   (bytes; DDP holds 8/4/4 x params)")
    for rank, got in sorted(checked.results.items()):
        for name, model in got["models"].items():
            want, impl = expected(model["numels"], got["world_size"]), model["impl"]
            grads = want["grad_shard_bytes"] if stage in ("zero2", "zero3") else None
            params = want["param_shard_bytes"] if stage == "zero3" else None
            print(f"{name:<6}{rank:>5}{want['params']:>8}{want['shard']:>7}{want['padding']:>5} | "
                  f"{impl['state_bytes'][-1]:>11}{want['adam_shard_bytes']:>9} | {impl['grad_bytes'][-1]:>7}"
                  f"{grads if grads else '-':>9} | {impl['param_bytes'][-1]:>7}{params if params else '-':>9}")


def traffic_table(checked: Checked | None, stage: str, step: int = -1) -> None:
    """One step's collectives per model: ours (from the check run) beside torch's DDP in the same run. "weighted":
    the bytes handed to the collectives, an all-reduce's counted twice (the ZeRO paper's units; see traffic)."""
    if not _passed(checked, stage):
        return
    for name, model in checked.results[0]["models"].items():
        for who in ("ddp", "impl", "fsdp"):
            if who in model:
                counts = traffic(model[who]["steps"][step])
                calls = ", ".join(f"{k.split(' ')[0]} {v} calls / {counts[k.replace('calls', 'bytes')]} B"
                                  for k, v in counts.items() if k.endswith("calls"))
                label = {"ddp": "torch DDP", "impl": f"{stage} (ours)", "fsdp": "torch fully_shard"}[who]
                print(f"{name:<5} {label:<18} weighted {counts['volume']:>6} B = "
                      f"{counts['volume'] / (4 * sum(model['numels'])):.2f} x 4Ψ   [{calls}]")


def event_order(checked: Checked | None, model: str = "mlp", step: int = 1, who: str = "impl") -> None:
    """The collectives and markers of one step on rank 0, in the order they happened."""
    if not _passed(checked, "zero3"):
        return
    for event in checked.results[0]["models"][model][who]["steps"][step]:
        if event["op"] == "mark":
            print(f"  -- {event['label']}" + (f" (full parameters held: {event['held']} B)" if "held" in event else ""))
        else:
            print(f"  {event['op']:<22}{event['bytes']:>6} B" + ("  async" if event["async"] else ""))


def holdings_figure() -> Any:
    """Who holds what, per stage: a row per rank, a column per kind of state (a drawing of the design, not a run)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    kinds = ("parameters", "gradients", "Adam state")
    sharded = {"DDP": (), "ZeRO-1": ("Adam state",), "ZeRO-2": ("gradients", "Adam state"),
               "ZeRO-3": kinds}
    widths = {"parameters": 1, "gradients": 1, "Adam state": 2}
    fig, axes = plt.subplots(1, 4, figsize=(11, 2.7), dpi=80, layout="constrained")
    for ax, (stage, split) in zip(axes, sharded.items(), strict=True):
        for rank in range(2):
            x = 0.0
            for kind in kinds:
                width = widths[kind]
                ax.add_patch(Rectangle((x, 1 - rank), width, 0.8, fill=False, ec="0.6"))
                part = (x + rank * width / 2, width / 2) if kind in split else (x, width)
                ax.add_patch(Rectangle((part[0], 1 - rank), part[1], 0.8,
                                       color={"parameters": "tab:blue", "gradients": "tab:orange",
                                              "Adam state": "tab:green"}[kind]))
                x += width + 0.2
            ax.text(-0.1, 1.4 - rank, f"rank {rank}", ha="right", va="center", fontsize=9)
        ax.set(xlim=(-1.2, 4.6), ylim=(-0.1, 1.9), title=stage)
        ax.axis("off")
    fig.legend(handles=[Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange", "tab:green")],
               labels=["parameters (4 B per value)", "gradients (4 B)", "Adam state (8 B)"], fontsize=9,
               loc="outside lower center", ncols=3)
    return fig



def fsdp_comparison(checked: Checked | None) -> None:
    """Ours beside FSDP2's fully_shard from the zero3 check run: bytes held per rank, and the parameters' distance."""
    if not _passed(checked, "zero3"):
        return
    for rank, got in sorted(checked.results.items()):
        for name in ("mlp", "odd"):
            fsdp, ours = got["models"][name]["fsdp"], got["models"][name]["impl"]
            print(f"rank {rank}, {name}: Adam state ours {ours['state_bytes'][-1]} B, fully_shard "
                  f"{fsdp['state_bytes'][-1]} B; parameters ours {ours['param_bytes'][-1]} B, fully_shard "
                  f"{fsdp['param_bytes'][-1]} B")
    worst = max(got["models"][name]["fsdp_diff"] for got in checked.results.values() for name in ("mlp", "odd"))
    assert worst < TOLERANCE, worst  # catches a Zero3 (or a fully_shard) whose updates differ
    print(f"Our Zero3 equals fully_shard + AdamW after 5 steps on every rank (max abs diff {worst:.1g} < 1e-6).")


# PyTorch's recipe, recipes_source/zero_redundancy_optimizer.rst (pytorch/tutorials): peak GPU memory of rank 0 in MB
# (max_memory_allocated // 1e6) for 20 x Linear(2000, 2000), 2 ranks, Adam, with ZeroRedundancyOptimizer / without.
RECIPE_MB = {"model created": (335, 335), "DDP created": (656, 656), "before step()": (992, 992),
             "after step()": (1361, 1697)}
RECIPE_MODEL_MB = 4 * 20 * 2000 * 2001 / 1e6  # 320.16 MB of fp32 parameters


def ladder_table(results: dict) -> dict[str, list[float]]:
    """The recipe's peaks beside this run's tensor bytes (rank 0), as multiples of the model's bytes; returns ours."""
    model_bytes = 4 * results[0]["n_params"]
    modes = [m for m in ("torch_zero", "ddp", "ours") if m in results[0]]
    ratios: dict[str, list[float]] = {mode: [] for mode in modes}
    print(f"{'':<15}{'the recipe (GPU peaks)':^34}| {'this run (tensor bytes, rank 0)':^36}")
    print(f"{'phase':<15}{'ZeRO MB':>8}{'x':>6}{'Adam MB':>9}{'x':>6}   |"
          f"{'ZeRO x':>10}{'Adam x':>10}{'our Zero1 x':>13}")
    for phase, (zero_mb, adam_mb) in RECIPE_MB.items():
        for mode in modes:
            ratios[mode].append(results[0][mode][phase] / model_bytes)
        ours = f"{ratios['ours'][-1]:>13.2f}" if "ours" in ratios else f"{'-':>13}"
        recipe = f"{zero_mb:>8}{zero_mb / RECIPE_MODEL_MB:>6.2f}{adam_mb:>9}{adam_mb / RECIPE_MODEL_MB:>6.2f}"
        print(f"{phase:<15}{recipe}   |{ratios['torch_zero'][-1]:>10.2f}{ratios['ddp'][-1]:>10.2f}{ours}")
    return ratios


def order_figure(checked: Checked | None, model: str = "mlp", step: int = 1) -> Any:
    """One step of the zero3 run on rank 0, in issue order: a bar per collective (height: bytes), a line per marker."""
    if not _passed(checked, "zero3"):
        return None
    import matplotlib.pyplot as plt

    events = checked.results[0]["models"][model]["impl"]["steps"][step]
    fig, ax = plt.subplots(figsize=(10, 2.8), dpi=80, layout="constrained")
    x, labels = 0, {}
    for event in events:
        if event["op"] == "mark":  # markers with no collective between them share one line
            labels.setdefault(x, []).append(event["label"].replace("forward end ", "fwd end ")
                                             .replace("forward start ", "fwd start ")
                                             .replace("backward start ", "bwd start "))
            continue
        ax.bar(x, event["bytes"], color="tab:blue" if event["op"].startswith("all_gather") else "tab:orange")
        x += 1
    for at, names in labels.items():
        ax.axvline(at - 0.5, color="k", lw=0.8, ls="--")
        ax.text(at - 0.4, 0.97, "\n".join(names), va="top", fontsize=8, transform=ax.get_xaxis_transform())
    ax.set_xticks(range(x), [str(i + 1) for i in range(x)])
    ax.set(xlabel="collectives of one step, in the order this rank issued them", ylabel="bytes (full tensor)",
           xlim=(-1, x + 1.5))
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange")],
              labels=["all-gather", "reduce-scatter"], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig
