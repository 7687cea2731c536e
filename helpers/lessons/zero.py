"""Lesson 09 (build ZeRO yourself): the checks of the four steps, the formulas they compare with, and pictures.

    from helpers.lessons.zero import check_step, check_many, traffic, holdings_figure
    checked = check_step("zero2", "my_zero2.py")    # prints "Correct: ..." or "Not yet: ..."; bool(checked)
    verdicts = check_many([("zero1", "a.py"), ("zero2", "b.py")])   # one launch; each .message as check_step prints it

check_step launches helpers/workers/zero_check.py on 2 ranks, and `judge` decides from what every rank handed back,
in this order: what the constructor issued; the shards' layout; the plan of collectives (which ones, how many calls
and bytes, when each was issued and when waited for); the bytes held, a copy kept alive behind a view, and any other
tensor kept; and only then the numbers (gradients, shards and parameters after every step against torch's DDP in the
same run). A wrong class so hears first about its structure, which names the mistake, rather than "the parameters
differ by 0.06"; a wrong number is read for what it says (2 or 1/N times DDP's, NaN from an output read before its
wait(), values from before the step or from the wrong end of the gathered buffer). Every number it compares with
comes from a formula in this file or from torch's DDP in the same run; every measured number comes from the run.
"""
from __future__ import annotations

import math
import re
import sys
from pathlib import Path
from typing import Any

from helpers import LaunchTimeout, WorkerFailed, launch
from helpers.kit import WORKERS
from helpers.kit.zero import ACCUMULATE_STEP, is_call, shard_size
from helpers.launcher.api import launch_server_pid
from helpers.lessons.checks import announce_run, explain_crash

STAGES = ("bucketed", "zero1", "zero2", "zero3")
TOLERANCE = 1e-6
VOLUME = {"all_reduce": 2, "reduce_scatter_single": 1, "reduce_scatter_tensor": 1, "all_gather_single": 1,
          "all_gather_into_tensor": 1, "broadcast": 1, "all_gather": 1, "reduce_scatter": 1}
BROADCASTS = ("broadcast", "_broadcast_coalesced")  # what DDP's constructor issues (_sync_module_states)


def expected(numels: list[int], world_size: int) -> dict[str, int]:
    """Bytes one rank should hold under the lesson's sharding (fp32, Adam's two moments), and the padding."""
    shard = sum(shard_size(n, world_size) for n in numels)
    return {"params": sum(numels), "shard": shard, "padding": shard * world_size - sum(numels),
            "adam_shard_bytes": 8 * shard, "grad_shard_bytes": 4 * shard, "param_shard_bytes": 4 * shard}


def traffic(events: list[dict]) -> dict[str, int]:
    """Calls and bytes per operation in one step's events, and the volume in the ZeRO paper's units: the bytes
    handed to each collective (the full tensor), weighted by the paper's convention: an all-reduce of B bytes
    counts 2B (a reduce-scatter plus an all-gather), every other collective B. Not bytes measured on a wire
    (wire_table shows those for gloo)."""
    out: dict[str, int] = {"volume": 0}
    for event in filter(is_call, events):
        out[f"{event['op']} calls"] = out.get(f"{event['op']} calls", 0) + 1
        out[f"{event['op']} bytes"] = out.get(f"{event['op']} bytes", 0) + event["bytes"]
        out["volume"] += VOLUME.get(event["op"], 1) * event["bytes"]
    return out


def _calls(events: list[dict], prefix: str = "") -> list[dict]:
    return [e for e in events if is_call(e) and e["op"].startswith(prefix)]


def _bytes_of(events: list[dict], prefix: str) -> int:
    return sum(e["bytes"] for e in _calls(events, prefix))


def _waits(events: list[dict]) -> dict[int, int]:
    """Which calls were waited for in these events: call id -> the wait's position."""
    return {e["id"]: i for i, e in enumerate(events) if e["op"] == "wait"}


def _backward_end(events: list[dict]) -> int:
    return next(i for i, e in enumerate(events) if e.get("label") == "backward end")


# ---------------------------------------------------------------------------- the checks, in the order they run

def _construction_problem(stage: str, model: dict, rank: int, world_size: int, cap_mb: float) -> str | None:
    """The constructor's collectives, logged apart from step 0: a broadcast of rank 0's state is allowed (DDP's
    constructor does that), anything else is not part of the plan."""
    ops = sorted({e["op"] for e in _calls(model["construction"])} - set(BROADCASTS))
    if ops:  # catches a constructor that all-reduces or gathers (the parameters start equal on every rank)
        ddp = sorted({e["op"] for e in _calls(model["ddp"]["construction"])})
        return (f"building the {stage} class issued {ops}; a constructor may broadcast rank 0's parameters (torch's "
                f"DDP constructor issued {ddp} in the same run), nothing else.")
    return None


def _close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(a - b) <= TOLERANCE for a, b in zip(got, want, strict=True))


def _layout_problem(stage: str, model: dict, rank: int, world_size: int, cap_mb: float) -> str | None:
    """Every parameter keeps its shape; each rank's shard, read right after the constructor, is its chunk of the
    flattened parameter padded with zeros at the end (the lesson's rule)."""
    stopped = model.get("stopped")  # the worker stopped a unit about to run with a changed shape (ShapeChanged)
    for when, shapes in (("after the constructor", model["shapes"]),
                         *([(stopped["when"], {stopped["name"]: stopped["shape"]})] if stopped else []),
                         ("after training", model["shapes_after"])):
        for name, shape in shapes.items():  # catches `p.data = torch.empty(0)` in place of free_storage
            if shape != model["reference_shapes"][name]:
                return (f"{when} {name} has shape {shape}, where the model's parameter has "
                        f"{model['reference_shapes'][name]}: free the storage with free_storage(p), not by replacing "
                        "p.data; free_storage keeps the shape. Giving p.data a new, empty tensor changes the shape "
                        "the model and autograd read, and the views autograd saved for backward keep the old memory "
                        "alive.")
    if stage == "bucketed":
        return None
    if not model["has_shards"] or len(model["shards"]) != len(model["names"]):
        return ("`shards` should map every parameter to this rank's shard (one shard per parameter: the layout "
                "this exercise grades).")
    for name, numel in zip(model["names"], model["numels"], strict=True):
        size, values = shard_size(numel, world_size), model["shards"][name]
        padding = [0.0] * (size * world_size - numel)
        padded, initial = model["initial"][name] + padding, model["initial"][name]
        rule = (f"right after the constructor, rank {rank}'s shard of {name} ({numel} values) should be values "
                f"[{rank * size}, {(rank + 1) * size}) of the flattened parameter, zero-padded to {size * world_size}")
        if len(values) != size:  # catches a shard of n // N or n // N + 1 values
            return f"{rule}: S = ⌈{numel}/{world_size}⌉ = {size} values; it holds {len(values)}."
        if _close(values, padded[rank * size:(rank + 1) * size]):
            continue
        for other in range(world_size):  # catches a rank that keeps another rank's chunk
            if _close(values, padded[other * size:(other + 1) * size]):
                return (f"{rule}; it holds chunk {other}, values [{other * size}, {(other + 1) * size}): rank r keeps "
                        "chunk r.")
        if _close(values, (padding + initial)[rank * size:(rank + 1) * size]):  # catches padding in front
            return f"{rule}; it holds a chunk of the parameter padded in front: the zeros go at the end."
        return f"{rule}; it holds other values."
    return None


def _plan_problem(stage: str, model: dict, rank: int, world_size: int, cap_mb: float) -> str | None:
    return _bucket_problem(model, cap_mb) if stage == "bucketed" else _zero_plan_problem(stage, model, world_size)


def _bucket_problem(model: dict, cap_mb: float) -> str | None:
    # the plan: the buckets torch's DDP all-reduced in the same run, in its last step (after its bucket rebuild)
    plan = [e["bytes"] for e in _calls(model["ddp"]["steps"][-1], "all_reduce")]
    ddp_ops = sorted({e["op"] for events in model["ddp"]["steps"] for e in _calls(events)})
    for step, events in enumerate(model["impl"]["steps"]):
        calls = _calls(events)
        sizes = [e["bytes"] for e in calls if e["op"] == "all_reduce"]
        if len(calls) != len(sizes):  # catches a broadcast or reduce-scatter where an all-reduce belongs
            return (f"step {step} issued {sorted({e['op'] for e in calls})}; torch's DDP issued {ddp_ops} in its "
                    "steps of the same run (its constructor's broadcast is logged apart).")
        if step == ACCUMULATE_STEP:  # two backward passes: the plan twice
            continue
        if sizes != plan:  # catches one all-reduce per parameter, a bucket never closed, the wrong order, a repeat
            if not sizes and step > 0:  # catches counts of ready gradients never reset after a step
                return (f"step {step} all-reduced no bucket, though step 0 did: did you reset the per-bucket counts "
                        f"of ready gradients after each step? The bucket plan is {plan}.")
            return (f"step {step} all-reduced buckets of {sizes} bytes; the bucket plan (the buckets torch's DDP "
                    f"all-reduced in the same run after its rebuild, cap {cap_mb} MiB, gradients back to front) "
                    f"is {plan}: a bucket closes once it holds at least the cap, and never splits a gradient.")
        end, waits = _backward_end(events), _waits(events)
        if any(i > end for i, e in enumerate(events) if is_call(e)) or any(not e["async"] for e in calls):
            return ("the all-reduces must start during backward (async_op=True, from the gradient hooks), "
                    "not after it; wait for them in finish_gradient_synchronization.")
        if any(waits.get(e["id"], end) < end for e in calls):  # catches a hook that waits at once
            return ("a bucket's all-reduce was waited for during backward, in the gradient hook: wait for the buckets "
                    "in finish_gradient_synchronization, after backward, so that backward goes on computing the "
                    "earlier layers' gradients while they travel.")
        if any(e["id"] not in waits for e in calls):  # catches averages copied before the all-reduce finished
            return ("an all-reduce was never waited for in its step: wait() for every bucket in "
                    "finish_gradient_synchronization before reading its sums.")
    return None


def _zero_plan(stage: str, model: dict, world_size: int) -> dict[str, tuple[int, int, str]]:
    """Per kind of collective: the most calls (one per parameter; fewer when parameters are grouped into one
    call, as the ZeRO paper's buckets and FSDP2's units do), the exact bytes, and the rule in words."""
    full = 4 * expected(model["numels"], world_size)["shard"] * world_size  # the padded parameters, in bytes
    n_params = len(model["numels"])
    if stage != "zero3":
        return {"reduce_scatter": (n_params, full, "one per parameter"),
                "all_gather": (n_params, full, "one per parameter")}
    units = model["units"]
    return {"reduce_scatter": (n_params, full, "one per parameter"),
            "all_gather": (2 * sum(len(unit) for unit in units),
                           2 * sum(4 * shard_size(n, world_size) * world_size for unit in units for n in unit),
                           "one per parameter of each unit, in forward and again in backward")}


def _zero_plan_problem(stage: str, model: dict, world_size: int) -> str | None:
    plan = _zero_plan(stage, model, world_size)
    for step, events in enumerate(model["impl"]["steps"]):
        ops = {e["op"] for e in _calls(events)}
        if "all_reduce" in ops:  # catches a ZeRO that all-reduces the gradients
            return f"step {step} all-reduced; reduce-scatter the gradients instead (each rank needs its shard only)."
        others = sorted(op for op in ops if not op.startswith(("reduce_scatter", "all_gather")))
        if others:  # catches any collective outside the plan (a broadcast of the parameters, ...)
            return (f"step {step} issued {others}; the plan is reduce-scatters and all-gathers only: gather every "
                    "rank's shard with dist.all_gather_single.")
        if step == ACCUMULATE_STEP:  # two forward and backward passes: checked for their values only
            continue
        if stage == "zero3":
            problem = _zero3_order_problem(events, model["units"], world_size)
            if problem:
                return f"step {step}{problem}"
        for op, (most, should, rule) in plan.items():  # catches a collective repeated, missing, or of the wrong size
            calls, moved = len(_calls(events, op)), _bytes_of(events, op)
            if moved != should or not 1 <= calls <= most:
                return (f"step {step} issued {calls} {op} calls moving {moved} bytes; the plan is {rule} ({most} "
                        f"calls, or fewer when you group parameters into one call) moving {should} bytes.")
        waits = _waits(events)
        pending = [e for e in _calls(events) if e["async"] and e["id"] not in waits]
        if pending:  # catches an async reduce-scatter whose output is read before it finished
            return (f"step {step} issued {len(pending)} {'/'.join(sorted({e['op'] for e in pending}))} call(s) with "
                    "async_op=True and never waited for them in that step: call wait() on the work a call returns "
                    "before you read its output (until then the output holds whatever that memory held).")
        end = _backward_end(events)
        if stage != "zero1" and _bytes_of(events[end:], "reduce_scatter"):  # catches the reduce-scatter left to step()
            return f"step {step} reduce-scattered after backward; do it in the gradient hook, during backward."
        if stage == "zero3" and events[end]["held"]:  # catches parameters freed in step(), not after the reduce
            return (f"step {step}: when backward ended this rank still held {events[end]['held']} bytes of full "
                    "parameters; free each parameter once its gradient is reduce-scattered (in the gradient hook).")
        if stage == "zero3":  # catches parameters kept gathered through backward, freed only at its end
            problem = _backward_held_problem(events, model["units"])
            if problem:
                return f"step {step}: {problem}"
    return None


def _backward_held_problem(events: list[dict], units: list[list[int]]) -> str | None:
    """The bytes of full parameters held when unit i's backward starts (after the class's backward pre-hook): at most
    unit i's and unit i-1's (the prefetched unit, which a class may give memory when it issues its all-gather). The
    units after i ran their backward already, and their gradients went out: a class that frees each parameter in its
    gradient hook holds none of them."""
    full_bytes = [4 * sum(unit) for unit in units]
    for event in events:
        match = re.fullmatch(r"backward start (\d+)", event.get("label") or "")
        if not match or "held" not in event:
            continue
        i = int(match[1])
        allowed = full_bytes[i] + (full_bytes[i - 1] if i > 0 else 0)
        if event["held"] > allowed:
            need = f"units {i} and {i - 1} (the one prefetched) need" if i > 0 else f"unit {i} needs"
            return (f"when unit {i}'s backward started this rank held {event['held']} bytes of full parameters, more "
                    f"than {need} ({allowed}): the units after it have finished their backward, so free each "
                    "parameter as soon as its gradient is reduce-scattered (in the gradient hook), not later.")
    return None


def _zero3_order_problem(events: list[dict], units: list[list[int]], world_size: int) -> str | None:
    """', ...' when the all-gathers of a ZeRO-3 step are blocking, issued too late or too early, or a prefetch is
    waited for before the compute it should overlap (see _prefetch_problem)."""
    if _calls(events[_backward_end(events):], "all_gather"):  # catches the all-gathers of ZeRO-1/2 left in step()
        return (" all-gathered after backward, in step(): ZeRO-3 gathers each unit just before it runs (in its "
                "forward pre-hook), so step() only updates the shards.")
    blocking = sum(1 for e in _calls(events, "all_gather") if not e["async"])
    if blocking:  # catches a "prefetch" that blocks: issued early, on a CPU backend it still overlaps nothing
        return (f" issued {blocking} all-gathers with async_op=False; start every unit's all-gathers with "
                "async_op=True and wait for them only when that unit starts: on a CPU backend a blocking call "
                "returns only once the data has arrived, so an early blocking 'prefetch' overlaps nothing.")
    problem = _prefetch_problem(events, units, world_size)
    return f": {problem}" if problem else None


def _waited_early(gathers: list[dict], unit_bytes: int, waits: set[int]) -> bool:
    """True when one of the last all-gathers issued (those of the unit just prefetched) was already waited for."""
    total = 0
    for event in reversed(gathers):
        if total >= unit_bytes:
            break
        total += event["bytes"]
        if event["id"] in waits:
            return True
    return False


def _prefetch_problem(events: list[dict], units: list[list[int]], world_size: int) -> str | None:
    """This lesson's prefetch rule, read from the order of one step's events. All-gathers issued by each marker: by
    the start of unit i's forward (a pre-hook registered after the class's) and by its end, those of units 0..i+1
    exactly; by the start of unit i's backward, those of all units in forward and of units i-1..last in backward,
    exactly. And the all-gathers of the unit just prefetched are not yet waited for when the current unit starts
    computing. Order of issue and of waiting: not a measurement of overlap."""
    unit_bytes = [sum(4 * shard_size(n, world_size) * world_size for n in unit) for unit in units]
    full_bytes = [4 * sum(unit) for unit in units]
    last, issued, gathers, waits = len(units) - 1, 0, [], set()
    for event in events:
        if event["op"] == "wait":
            waits.add(event["id"])
        elif is_call(event) and event["op"].startswith("all_gather"):
            issued += event["bytes"]
            gathers.append(event)
        match = re.fullmatch(r"(forward start|forward end|backward start) (\d+)", event.get("label") or "")
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
                return (f"unit {min(i + 1, last)}'s all-gather was not issued by the {where} of unit {i}'s forward. "
                        f"On a CPU backend this process computes unit {i} before its next hook runs, so an all-gather "
                        f"issued later cannot overlap unit {i}: issue it (async_op=True) in unit {i}'s forward "
                        f"pre-hook, before unit {i} computes.")
            if issued > want:  # catches gathering further ahead (every unit at once: the whole model resident)
                return (f"by the {where} of unit {i}'s forward this rank had issued all-gathers of {issued} bytes, "
                        f"more than units 0..{min(i + 1, last)} need ({want}): gather only the next unit ahead.")
            if where == "start" and i < last and _waited_early(gathers, unit_bytes[i + 1], waits):
                return (f"unit {i + 1}'s all-gather was issued before unit {i} computed, and waited for before unit "
                        f"{i} computed too: a prefetch waited for at once overlaps nothing, on any backend. Wait for "
                        f"it when unit {i + 1} starts (in its forward pre-hook).")
        else:
            want = sum(unit_bytes) + sum(unit_bytes[max(i - 1, 0):])
            if issued < want:  # catches a backward without prefetch, or one that prefetches the wrong way
                return (f"unit {i - 1}'s all-gather was not issued when unit {i}'s backward started (no backward "
                        f"prefetch: backward runs the units from last to first, so unit {i}'s backward pre-hook "
                        f"starts unit {i - 1}'s all-gather).")
            if issued > want:  # catches gathering further ahead in backward
                return (f"when unit {i}'s backward started this rank had issued all-gathers of {issued} bytes in "
                        f"this step, more than forward and units {max(i - 1, 0)}..{last} need ({want}).")
            if i > 0 and _waited_early(gathers, unit_bytes[i - 1], waits):
                return (f"unit {i - 1}'s all-gather was issued before unit {i}'s backward computed, and waited for "
                        f"before it computed too: a prefetch waited for at once overlaps nothing, on any backend. Wait "
                        f"for it when unit {i - 1}'s backward starts.")
    return None


def _hidden_problem(model: dict, world_size: int) -> str | None:
    """A storage behind the class's own tensors that holds more than they use (helpers.kit.zero.hidden_storage)."""
    numels = dict(zip(model["names"], model["numels"], strict=True))
    for step, (backward, after) in enumerate(zip(model["impl"]["other"][::2], model["impl"]["other"][1::2],
                                                 strict=True)):
        for other in (backward, after):
            hidden = other.get("hidden")
            if not hidden:
                continue
            text = (f"step {step}, {other['when']}: {hidden['what']} is a view into a storage of {hidden['bytes']} "
                    f"bytes, of which your class's tensors use {hidden['used']}: the other "
                    f"{hidden['bytes'] - hidden['used']} bytes are a copy kept alive behind the view.")
            name = hidden["what"].rsplit(" of ", 1)[-1]
            if name in numels and hidden["bytes"] == 4 * shard_size(numels[name], world_size) * world_size:
                text += (f" That storage is exactly {name} flattened and padded to {world_size} x "
                         f"{shard_size(numels[name], world_size)} values: padded_flat(p, N).chunk(N)[r] is a view of "
                         "that whole padded copy, and a shard kept as the view keeps the copy; keep a .clone() of the "
                         "chunk instead.")
            else:
                text += " Keep a .clone() of the part you need, so that the rest is freed."
            return text
    return None


def _memory_problem(stage: str, model: dict, rank: int, world_size: int, cap_mb: float) -> str | None:
    if stage == "bucketed":
        return None
    hidden = _hidden_problem(model, world_size)  # catches a shard that is a view of a whole padded copy
    if hidden:
        return hidden
    want, impl = expected(model["numels"], world_size), model["impl"]
    held = {"Adam state": (impl["state_bytes"][-1], want["adam_shard_bytes"], "8 bytes x shard")}
    if stage in ("zero2", "zero3"):  # catches a Zero2 that keeps the full gradients too
        held["gradients after backward"] = (impl["grad_bytes"][-1], want["grad_shard_bytes"], "4 bytes x shard")
    if stage == "zero3":  # catches parameters left gathered after the step
        held["parameters after the step"] = (impl["param_bytes"][-1], want["param_shard_bytes"], "4 bytes x shard")
    for what, (got, should, formula) in held.items():
        if got != should:
            message = f"it holds {got} bytes of {what}; {formula} = {should} ({want['shard']} values per rank)."
            if what == "gradients after backward" and got < should:  # catches gradients kept outside .grad
                message += (" When backward returns, each shard's averaged gradient must be in its .grad (this "
                            "exercise waits for each reduce-scatter in its hook; FSDP2 waits for its own at the end of "
                            "backward), so that code between backward and step(), such as gradient clipping, can "
                            "read it.")
            elif what == "gradients after backward":  # catches a hook that leaves p.grad in place
                full = 4 * sum(model["numels"])
                message += (f" The full gradients ({full} bytes) are still held: set p.grad = None in the hook, once "
                            "its gradient is reduce-scattered." if got - should == full else
                            f" That is {got - should} bytes more: set each p.grad = None in its hook, once its "
                            "gradient is reduce-scattered.")
            return message
    for step, (backward, after) in enumerate(zip(impl["other"][::2], impl["other"][1::2], strict=True)):
        for other in (backward, after):  # catches gather buffers or full gradients kept on the side
            if other["bytes"]:
                return (f"step {step}, {other['when']}: the class and the model held {other['bytes']} bytes in "
                        f"{other['tensors']} tensor storage(s) that are none of the parameters, gradients, shards, "
                        f"shards' gradients or optimizer state (the largest, of shape {other['largest']}, at "
                        f"{other['where']}); free buffers once used.")
    return None


def _right(got: dict) -> bool:
    return got["diff"] is not None and got["diff"] <= TOLERANCE * max(1.0, got["scale"])


HELD = ("this check keeps the output of every async_op=True all-reduce, reduce-scatter and all-gather (list forms "
        "included; any part that another argument shares, such as an in-place all-gather's own chunk, excepted) at "
        "NaN until your code waits for it (on a real run that "
        "memory holds whatever it held before, or part of the result, depending on timing)")


def _scaled(got: dict, factor: float) -> bool:
    """The tensor is DDP's times `factor` (within the tolerance), not just correlated with it."""
    return (got["ratio"] is not None and abs(got["ratio"] - factor) < 1e-3
            and got.get("fit", 0.0) <= TOLERANCE * max(1.0, got["scale"]))


def _nan_message(stage: str, what: str, step: int, asynchronous: bool) -> str:
    if not asynchronous:
        return (f"after step {step}'s backward {what} holds NaN, and none of this step's collectives was async: the "
                "NaN comes from your own arithmetic, or from memory read before anything was written into it (a "
                "torch.empty buffer).")
    fix = ("in finish_gradient_synchronization, wait() for a bucket's all-reduce before you divide and copy it"
           if stage == "bucketed" else "wait() for each reduce-scatter before you read its output")
    return (f"after step {step}'s backward {what} holds NaN: {HELD}, so NaN here means a buffer was read before its "
            f"wait(): {fix}.")


def _gradient_message(stage: str, name: str, got: dict, step: int, rank: int, world_size: int,
                      numel: int, asynchronous: bool = False) -> str:
    what = "the gradient" if stage == "bucketed" else "the gradient shard"
    if got["diff"] is not None and math.isnan(got["diff"]):  # catches a buffer read before its wait()
        return _nan_message(stage, f"{what} of {name}", step, asynchronous)
    if _scaled(got, world_size):  # catches a sum not divided by N
        return (f"after step {step}'s backward {what} of {name} is {world_size} times DDP's averaged gradient: "
                "divide the summed gradient by the world size, after the collective's wait() or before you issue "
                "it (as torch's allreduce_hook does); a division in between is lost here (this check delivers the "
                "result at wait()).")
    if _scaled(got, 1 / world_size):  # catches an average divided by N again (ReduceOp.AVG, then / N)
        return (f"after step {step}'s backward {what} of {name} is 1/{world_size} of DDP's averaged gradient: it was "
                "divided by the world size twice (op=ReduceOp.AVG already divides the sum by it); divide once.")
    if step == ACCUMULATE_STEP:  # catches a gradient replaced, not added, by the second backward pass
        fix = ("add each pass's reduce-scattered gradient to the shard's .grad when it already holds one, instead "
               "of replacing it" if stage != "bucketed" else "each pass's averages must add to what .grad holds")
        return (f"step {step} runs two backward passes before step() (gradient accumulation); after them {what} of "
                f"{name} differs from DDP's, which adds up both passes, by up to {got['diff']:.2g} (steps 0 to "
                f"{step - 1}, one backward each, were right): {fix}.")
    if step > 0:  # catches a full gradient never cleared, a counter never reset
        return (f"after step {step}'s backward {what} of {name} differs from DDP's by up to {got['diff']:.2g}, though "
                "every step before was right: something carried over from the previous step (zero_grad must clear "
                "every full .grad; any per-step counter or buffer must start afresh).")
    if stage == "bucketed":  # catches a lost gradient, or one copied back into the wrong parameter
        return (f"after step 0's backward the gradient of {name} differs from DDP's averaged gradient "
                f"(max abs difference {got['diff']:.2g}).")
    size = shard_size(numel, world_size)  # catches a gradient shard taken from the wrong place, a wrong scale
    found = ("it has no gradient." if got["numel"] is None else f"it has {got['numel']} values."
             if got["diff"] is None else f"it differs by up to {got['diff']:.2g}.")
    return (f"after step 0's backward the gradient shard of {name} should be values [{rank * size}, "
            f"{(rank + 1) * size}) of DDP's averaged gradient, flattened and zero-padded to {size * world_size}; "
            f"{found}")


def _unit_nan_problem(events: list[dict]) -> str | None:
    """A unit that started its forward or backward with NaN in a parameter (the harness's markers record it)."""
    for event in events:
        if event.get("nan"):
            when, i = event["label"].rsplit(" start ", 1)
            return (f"unit {i} started its {when} with {', '.join(event['nan'])} holding NaN, though every shard "
                    f"was right: {HELD}, so your class copied a gathered buffer into the parameter before waiting for "
                    "its all-gather. Wait for the work first, then alloc_storage(p) and copy.")
    return None


def _params_message(stage: str, row: dict, step: int, numels: dict[str, int]) -> str:
    """The parameters are wrong though the shards are right: where the wrong values came from (the worker's
    `placed`: the values before the step, or the right values read from the wrong offset of the gathered buffer)."""
    head = f"after step {step} the parameters differ from torch's DDP by up to {row['params']:.2g}, though "
    if stage == "bucketed":
        return head + "the gradients were right."
    name, where = next(iter(row.get("placed", {}).items()), (None, {}))
    if where.get("offset"):  # catches a parameter unpadded from the wrong end of the gathered buffer
        n, k = numels[name], where["offset"]
        detail = (f"{name} holds values [{k}, {k + n}) of DDP's updated {name} gathered and padded to "
                  f"{where['padded']} values, where the parameter is the first {n}, [0, {n}): the padding sits at the "
                  "end of the gathered buffer, so copy its first p.numel() values (full[:p.numel()]).")
    elif where.get("before"):  # catches an all-gather issued before the optimizer step
        detail = (f"{name} still holds its values from before this step's update: all-gather the shards after "
                  "self.optimizer.step() has updated them, and copy the result into the parameter.")
    else:  # catches updated shards never copied back
        detail = ("the all-gathered values did not land in the parameters: after the optimizer step, all-gather every "
                  "updated shard and copy the first p.numel() values of the result into its parameter.")
    return head + "the shards equal DDP's updated values: " + detail


def _values_problem(stage: str, model: dict, rank: int, world_size: int, cap_mb: float) -> str | None:
    """After every step: NaN in a unit's parameters when it started, the gradients the optimizer used, then the
    shards, then the full parameters. NaN is never within the tolerance."""
    numels = dict(zip(model["names"], model["numels"], strict=True))
    for step, row in enumerate(model["values"]):
        events = model["impl"]["steps"][step]
        problem = _unit_nan_problem(events) if stage == "zero3" else None
        if problem:  # catches a gathered buffer copied into its parameter before the wait
            return f"step {step}: {problem}"
        asynchronous = any(e["async"] for e in _calls(events))
        for name, got in row["grads"].items():
            if not _right(got):
                return _gradient_message(stage, name, got, step, rank, world_size, numels[name], asynchronous)
        if row["shards"] is not None and not row["shards"] <= TOLERANCE:  # catches an optimizer over shard copies
            return (f"after step {step}'s optimizer step the shards differ from DDP's updated parameters by up to "
                    f"{row['shards']:.2g}, though the gradient shards were right: build the optimizer over the shards "
                    "in `shards`, so that its step updates them.")
        if stage != "bucketed" and row["params"] is not None and math.isnan(row["params"]):  # read before its wait
            head = f"after step {step} the parameters hold NaN, though the shards equal DDP's updated values"
            if not asynchronous:
                return (f"{head}, and none of this step's collectives was async: the NaN comes from memory read before "
                        "anything was written into it (a torch.empty buffer).")
            return (f"{head}: {HELD}, so your class copied a gathered buffer into a parameter before waiting for its "
                    "all-gather. Wait for the work first, then copy.")
        if row["params"] is not None and not row["params"] <= TOLERANCE:  # catches updated shards not copied back
            return _params_message(stage, row, step, numels)
    if model["max_diff"] is None or not model["max_diff"] <= TOLERANCE:  # catches a stale shard, an update lost
        return (f"after 5 AdamW steps the parameters differ from torch's DDP by {model['max_diff']:.2g} (more than "
                f"{TOLERANCE:g}).")
    return None


CHECKS = (_construction_problem, _layout_problem, _plan_problem, _memory_problem, _values_problem)


def first_problem(stage: str, ranks: dict[int, dict]) -> str | None:
    """The first thing that is wrong, as the sentence after "Not yet: ", or None. Each kind of check runs on every
    rank and model before the next kind, so that a structural mistake anywhere is named before any number. (A class
    whose values held NaN on one model was not run on the next ones: the worker stops it there.)"""
    for find in CHECKS:
        for rank, got in sorted(ranks.items()):
            for name, model in got["models"].items():
                problem = find(stage, model, rank, got["world_size"], got["cap_mb"])
                if problem:
                    return f"rank {rank}, model '{name}': {problem}"
    return None


KEPT = ("no other tensor kept (searched from your class, its class attributes and the model), and no shard, gradient "
        "or Adam state a view of a larger copy")
WHAT = {"bucketed": "DDP's buckets, all-reduced during backward and waited for after it",
        "zero1": f"Adam state for its shards only (the bytes this stage shards), reduce-scatters and all-gathers as "
                 f"planned, {KEPT}",
        "zero2": f"Adam state and gradients for its shards only (the bytes this stage shards), reduce-scatters during "
                 f"backward, {KEPT}",
        "zero3": "parameters, gradients and Adam state for its shards only; each unit gathered before it runs and "
                 "freed after; the next unit's all-gather issued before this unit computes and waited for when it "
                 f"starts; {KEPT}"}


def judge(stage: str, ranks: dict[int, dict]) -> tuple[bool, str]:
    """The verdict on one class from the results of zero_check.py: (passed, the line check_step prints)."""
    problem = first_problem(stage, ranks)
    if problem:
        return False, f"Not yet: {problem}"
    mlp = ranks[0]["models"]["mlp"]
    ratio = traffic(mlp["impl"]["steps"][-1])["volume"] / traffic(mlp["ddp"]["steps"][-1])["volume"]
    return True, (f"Correct: {stage} equals DDP + AdamW after every step, on every rank, for mlp, odd and tied (step "
                  f"{ACCUMULATE_STEP} with two backward passes); {WHAT[stage]}. Per step it hands its collectives "
                  f"{ratio:.2f}x DDP's bytes, counted in the ZeRO paper's units (mlp).")


def check_results(stage: str, ranks: dict[int, dict]) -> bool:
    """Decide from one class's results (Checked.results) and print the verdict."""
    passed, message = judge(stage, ranks)
    print(message)
    return passed


class Checked:
    """One class's verdict: true when it passed; `.message` is the line check_step prints, `.results` every rank's
    results (None after a crash), `.script` the class's file."""

    def __init__(self, passed: bool, results: dict | None, script: str = "", message: str = "") -> None:
        self.passed, self.results, self.script, self.message = passed, results, script, message

    def __bool__(self) -> bool:
        return self.passed


def one_check(results: dict[int, dict], index: int) -> dict[int, dict]:
    """The results of the index-th class of a launch, per rank, in the shape the tables read: {"world_size",
    "cap_mb", "stage", "models": {name: torch's runs on that model (shared by every class) + the class's}}."""
    out = {}
    for rank, got in results.items():
        check = got["checks"][index]
        out[rank] = {"world_size": got["world_size"], "cap_mb": got["cap_mb"], "stage": check["stage"],
                     "models": {name: {**got["baselines"][name], **model} for name, model in check["models"].items()}}
    return out


GLOO_SIZE_CHECK = re.compile(r"worldSize == (input|output)Shape|invalid tensor size at index")
FREED = re.compile(r"out of bounds for storage of size 0")
STOPPED = re.compile(r"(?:[\w.]+\.)?StoppedByTheCheck: ")  # the harness's own stop (workers/zero_check.py)
HARNESS = "zero_check.py:"


def crash_message(error: WorkerFailed, what: str) -> str:
    """explain_crash's paragraph, with what gloo's shape check of a reduce-scatter or an all-gather means in this
    lesson (the launcher's general sentence replaced by one that names the lesson's padded_flat). When no line of the
    learner's file was running (the innermost line outside torch is the harness's, which ran the model with the
    class's hooks inside torch), the place says so instead of naming the harness's line as if it were the mistake;
    the harness's own stop says what the class did, in place of the error and its place."""
    where, text = getattr(error, "where", None), getattr(error, "error", None) or ""
    if isinstance(where, str) and where.startswith(HARNESS):
        stopped = STOPPED.match(text)
        if stopped:
            error.where, error.error = None, "the check stopped your class: " + text[stopped.end():]
        else:
            error.where = (f"{where}, the check's own line: torch raised this while it ran the model with your "
                           "class's hooks in it, so no line of your file was running")
    if FREED.search(text):
        error.meaning = ("a parameter whose storage free_storage had emptied (0 bytes) was used before alloc_storage "
                         "and a copy gave it its values again; on the tied model one weight sits in two units, so "
                         "freeing one unit frees the other's weight too")
    if GLOO_SIZE_CHECK.search(f"{error.error or ''}\n{error}"):
        error.meaning = ("gloo checks that a reduce-scatter's input holds exactly world_size times its output's values "
                         "(an all-gather's output world_size times its input's); a parameter whose size does not "
                         "divide by the world size must be padded with zeros first (padded_flat), so that every "
                         "rank's shard has the same size")
    elif getattr(error, "meaning", None) is None and getattr(error, "exitcode", None) == -11:  # SIGSEGV
        error.meaning = ("the process touched memory it does not own; in this lesson that is usually a copy into a "
                         "parameter whose storage free_storage emptied: call alloc_storage(p) before copying in")
    text = explain_crash(error, what)
    if isinstance(error, LaunchTimeout):
        text += (" A collective that only some ranks call waits for the others until the timeout (is one inside "
                 "`if rank == 0:`?).")
    return text


def check_many(checks: list[tuple[str, str | Path]], timeout: float = 300, nproc: int = 2) -> list[Checked]:
    """Check several classes in one launch, one after another beside one run of torch's DDP; each Checked's
    .message is what check_step prints for that class alone. A crash or a hang fails every class of the launch."""
    args: list[str] = []
    for stage, script in checks:
        if stage not in STAGES:
            raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
        args += ["--check", stage, str(Path(script).resolve())]
    what = (f"the {checks[0][0]} check of {Path(checks[0][1]).name}" if len(checks) == 1
            else f"the check of {len(checks)} classes")
    try:
        run = launch(WORKERS / "zero_check.py", nproc=nproc, echo=False, timeout=timeout, args=args)
    except WorkerFailed as error:  # LaunchTimeout included
        message = f"Not yet: {crash_message(error, what)}"
        return [Checked(False, None, str(Path(script).resolve()), message) for _, script in checks]
    out = []
    for index, (stage, script) in enumerate(checks):
        results = one_check(run.results, index)
        passed, message = judge(stage, results)
        out.append(Checked(passed, results, str(Path(script).resolve()), message))
    return out


def check_step(stage: str, script: str | Path, timeout: float = 120, nproc: int = 2,
               keep: dict | None = None) -> Checked:
    """Launch zero_check.py with the class in `script` on `nproc` ranks and decide. Prints what runs at once, then
    Correct or Not yet. keep: a dict that receives the run under `stage` when the check passes."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
    if not Path(script).is_file():
        message = f"Not yet: {script} does not exist yet: run the %%writefile cell above it first."
        print(message)
        return Checked(False, None, str(script), message)
    if launch_server_pid() is None and sys.platform.startswith("linux"):
        print("Starting this kernel's launch server first: it imports torch once, so this first check takes longer.",
              flush=True)
    announce_run(Path(script).name, nproc, timeout, stop_after=60)
    checked = check_many([(stage, script)], timeout, nproc)[0]
    print(checked.message)
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
    print("B: the bytes each rank held, read from its tensors (DDP holds 8, 4 and 4 B per value)\n"
          "values: the model's (Ψ); shard: values per rank, with the padding (pad)")
    print(f"{'model':<6}{'rank':>5}{'values':>8}{'shard':>7}{'pad':>5} | {'Adam B':>11}{'formula':>9} |"
          f" {'grad B':>7}{'formula':>9} | {'param B':>7}{'formula':>9}")
    for rank, got in sorted(checked.results.items()):
        for name, model in got["models"].items():
            want, impl = expected(model["numels"], got["world_size"]), model["impl"]
            grads = want["grad_shard_bytes"] if stage in ("zero2", "zero3") else None
            params = want["param_shard_bytes"] if stage == "zero3" else None
            print(f"{name:<6}{rank:>5}{want['params']:>8}{want['shard']:>7}{want['padding']:>5} | "
                  f"{impl['state_bytes'][-1]:>11}{want['adam_shard_bytes']:>9} | {impl['grad_bytes'][-1]:>7}"
                  f"{grads if grads else '-':>9} | {impl['param_bytes'][-1]:>7}{params if params else '-':>9}")


def traffic_table(checked: Checked | None, stage: str, step: int = -1) -> None:
    """One step's collectives per model: ours (from the check run) beside torch's DDP in the same run (and, for zero3,
    FSDP2's fully_shard). "weighted": the bytes handed to the collectives, an all-reduce's counted twice (the ZeRO
    paper's convention; see traffic), then divided by 4 bytes per value: in Ψ, the model's values."""
    if not _passed(checked, stage):
        return
    for name, model in checked.results[0]["models"].items():
        for who in ("ddp", "impl", "fsdp") if stage == "zero3" else ("ddp", "impl"):
            if who in model:
                counts = traffic(model[who]["steps"][step])
                calls = ", ".join(f"{k.split(' ')[0]} {v} calls / {counts[k.replace('calls', 'bytes')]} B"
                                  for k, v in counts.items() if k.endswith("calls"))
                label = {"ddp": "torch DDP", "impl": f"{stage} (ours)", "fsdp": "torch fully_shard"}[who]
                print(f"{name:<5} {label:<18} weighted {counts['volume']:>6} B = "
                      f"{counts['volume'] / (4 * sum(model['numels'])):.2f}Ψ   [{calls}]")


def event_order(checked: Checked | None, model: str = "mlp", step: int = 1, who: str = "impl") -> None:
    """The collectives, waits and markers of one step on rank 0, in the order they happened."""
    if not _passed(checked, "zero3"):
        return
    events = checked.results[0]["models"][model][who]["steps"][step]
    calls = {e["id"]: e for e in events if is_call(e)}
    for event in events:
        if event["op"] == "mark":
            print(f"  -- {event['label']}" + (f" (full parameters held: {event['held']} B)" if "held" in event else ""))
        elif event["op"] == "wait":
            waited = calls.get(event["id"])
            print(f"     wait for the {waited['op']} of {waited['bytes']} B" if waited else "     wait (earlier call)")
        else:
            print(f"  {event['op']:<22}{event['bytes']:>6} B" + ("  async" if event["async"] else ""))


KINDS = {"parameters": ("param_bytes", "tab:blue"), "gradients": ("grad_bytes", "tab:orange"),
         "Adam state": ("state_bytes", "tab:green")}


def holdings(runs: dict, model: str = "mlp") -> dict[str, dict[int, dict[str, int]]]:
    """Bytes each rank's tensors held after the last step (gradients: after its backward), per stage: torch's DDP and
    the ZeRO classes whose checks passed, read from the check runs in `runs`."""
    out: dict[str, dict[int, dict[str, int]]] = {}
    for stage, label in (("zero1", "ZeRO-1"), ("zero2", "ZeRO-2"), ("zero3", "ZeRO-3")):
        checked = runs.get(stage)
        if not checked:
            continue
        for rank, got in sorted(checked.results.items()):
            for who, name in (("ddp", "DDP"), ("impl", label)):
                record = got["models"][model][who]
                out.setdefault(name, {})[rank] = {kind: record[key][-1] for kind, (key, _) in KINDS.items()}
    return dict(sorted(out.items(), key=lambda item: ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3"].index(item[0])))


def holdings_figure(runs: dict, model: str = "mlp") -> Any:
    """Who holds what on each rank: a bar per rank and stage, its length the bytes its tensors held (read from the
    check runs: parameters and Adam state after the last step, gradients after its backward). Where a rank holds
    less than the whole of a kind, its part is drawn at its own place in the whole (rank r: the r-th part)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    held = holdings(runs, model)
    if not held:
        print("(no results yet: no ZeRO check has passed; run this cell again once one has)")
        return None
    fig, axes = plt.subplots(len(held), 1, figsize=(10, 0.9 + 0.95 * len(held)), dpi=80, layout="constrained",
                             sharex=True, squeeze=False)
    whole = held["DDP"][0]
    for ax, (stage, ranks) in zip(axes[:, 0], held.items(), strict=True):
        for row, (rank, kinds) in enumerate(sorted(ranks.items())):
            x = 0
            for kind, (_, colour) in KINDS.items():
                full, got, y = whole[kind], kinds[kind], len(ranks) - 1 - row
                ax.add_patch(Rectangle((x, y + 0.1), full, 0.8, fill=False, ec="0.7"))
                start = x + rank * got if got < full else x
                ax.add_patch(Rectangle((start, y + 0.1), min(got, full), 0.8, color=colour))
                if got > full:  # more than the whole: the shard copies the optimizer updates
                    ax.add_patch(Rectangle((x + full, y + 0.1), got - full, 0.8, color=colour, alpha=0.4, hatch="//"))
                x += max(full, got) + 2500
            ax.text(x, y + 0.5, f"{sum(kinds.values()):,} B", va="center", fontsize=9)
            ax.text(-600, y + 0.5, f"rank {rank}", ha="right", va="center", fontsize=9)
        ax.set(ylim=(0, len(ranks)), xlim=(-5000, 1.12 * x + 20000))
        ax.set_title(stage, loc="left", fontsize=10)
        ax.axis("off")
    fig.legend(handles=[Rectangle((0, 0), 1, 1, color=c) for _, c in KINDS.values()] +
               [Rectangle((0, 0), 1, 1, color="0.6", alpha=0.4, hatch="//")],
               labels=[*KINDS, "shard copies (beyond the whole)"], fontsize=9, loc="outside lower center", ncols=4)
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
    """One step of the zero3 run on rank 0, in issue order: a bar per collective (height: bytes, numbered), a dashed
    line per marker, each in its own slot, and a triangle "w<n>" below the axis where the class first waited for
    call n (between the slots of what came before and after it)."""
    if not _passed(checked, "zero3"):
        return None
    import matplotlib.pyplot as plt

    events = checked.results[0]["models"][model]["impl"]["steps"][step]
    fig, ax = plt.subplots(figsize=(10, 3.4), dpi=80, layout="constrained")
    x, marks, number, waits, ticks = 0, [], {}, [], []
    for event in events:
        if event["op"] == "mark":  # a slot of its own: two markers with nothing between them stay apart
            marks.append((x, event["label"].replace("forward ", "fwd ").replace("backward ", "bwd ")))
            x += 1
        elif event["op"] == "wait":
            waits.append((x - 0.5, number.get(event["id"])))
        else:
            number[event["id"]] = len(ticks) + 1
            ax.bar(x, event["bytes"], color="tab:blue" if event["op"].startswith("all_gather") else "tab:orange")
            ticks.append(x)
            x += 1
    for at, name in marks:
        ax.axvline(at, color="k", lw=0.8, ls="--")
        ax.text(at + 0.15, 0.98, name, va="top", rotation=90, fontsize=7, transform=ax.get_xaxis_transform())
    grouped: dict[float, list[int]] = {}
    for at, call in waits:
        grouped.setdefault(at, []).append(call)
    for at, calls in grouped.items():
        ax.plot(at, -0.17, marker="^", color="0.3", ms=6, clip_on=False, transform=ax.get_xaxis_transform())
        ax.text(at, -0.3, "w" + ",".join(map(str, calls)), ha="center", fontsize=8, color="0.3",
                transform=ax.get_xaxis_transform())
    ax.set_xticks(ticks, [str(i + 1) for i in range(len(ticks))], fontsize=7)
    top = max((e["bytes"] for e in events if is_call(e)), default=1)
    ax.set(ylabel="bytes (full tensor)", xlim=(-1, x + 0.5), ylim=(0, 1.7 * top))  # room for the markers' names
    ax.set_title("collectives of one step, numbered in the order this rank issued them; ▲ w<n>: where it waited for "
                 "call n", fontsize=9, loc="left", pad=4)
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in ("tab:blue", "tab:orange")],
              labels=["all-gather", "reduce-scatter"], fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    return fig


def fsdp_by_the_same_rule(checked: Checked | None, model: str = "mlp", step: int = 1) -> str | None:
    """torch's fully_shard, from the zero3 check run, judged by this lesson's prefetch rule; prints the verdict."""
    if not _passed(checked, "zero3"):
        return None
    got = checked.results[0]["models"][model]
    problem = _prefetch_problem(got["fsdp"]["steps"][step], got["units"], checked.results[0]["world_size"])
    print(f"torch's fully_shard, step {step} on rank 0, read by the same rule: "
          + (f"Not yet: {problem}" if problem else "it passes."))
    return problem


RING = {"all_reduce": 2, "reduce_scatter_single": 1, "all_gather_single": 1, "broadcast, one per owner": 1}
DESIGNS = {"DDP: all-reduce": {"all_reduce": 1},
           "ZeroRedundancyOptimizer: all-reduce + broadcasts": {"all_reduce": 1, "broadcast, one per owner": 1},
           "our Zero1, Zero2: reduce-scatter + all-gather": {"reduce_scatter_single": 1, "all_gather_single": 1},
           "our Zero3: reduce-scatter + 2 all-gathers": {"reduce_scatter_single": 1, "all_gather_single": 2}}


def wire_table(wire_runs: dict[int, Any]) -> dict[int, dict[str, float]] | None:
    """What each rank sent for one collective on gloo (zero_wire.py's runs, by world size) beside the ring formula
    (N-1)/N per reduce-scatter, all-gather or broadcast of the whole, twice that per all-reduce; then a step of each
    design: the measured collectives added up, in bytes sent per byte of the model, beside the same formula. Returns
    the measured fractions (rank 0), or None where /proc/self/io could not be read."""
    sent = {n: run.results[0]["sent"] for n, run in sorted(wire_runs.items())}
    if any(value is None for value in sent.values()):
        print("(not measured: this system has no /proc/self/io to count a process's writes)")
        return None
    head = "".join(f"{f'{n} ranks: gloo':>16}{'ring':>7}" for n in sent)
    print(f"{'one collective, bytes sent per byte of the tensor':<52}{head}")
    for op, weight in RING.items():
        cells = "".join(f"{sent[n][op]:>16.2f}{weight * (n - 1) / n:>7.2f}" for n in sent)
        print(f"  {op:<50}{cells}")
    print(f"{'one step, bytes sent per byte of the model':<52}{head}")
    for design, uses in DESIGNS.items():
        cells = "".join(f"{sum(k * sent[n][op] for op, k in uses.items()):>16.2f}"
                        f"{sum(k * RING[op] * (n - 1) / n for op, k in uses.items()):>7.2f}" for n in sent)
        print(f"  {design:<50}{cells}")
    return sent


def recipe_model_blocks() -> int:
    """Arithmetic, not a measurement (no GPU here): the bytes the CUDA caching allocator hands out for the recipe's
    20 x Linear(2000, 2000), by its rules (constants: torch/include/c10/core/AllocatorConfig.h:19-25; rules:
    c10/cuda/CUDACachingAllocator.cpp in PyTorch's source). round_size rounds a request up to 512 B;
    get_allocation_size rounds a request of 10 MiB or more up to 2 MiB; should_split splits a large block only if more
    than 1 MiB would remain; the peak statistic counts the allocated block. Prints the sum; returns it."""
    min_block, small_size, round_large = 512, 1048576, 2097152
    weight, bias = 4 * 2000 * 2000, 4 * 2000  # bytes of one Linear(2000, 2000)'s weight and bias
    segment = -(-weight // round_large) * round_large
    remainder = segment - weight
    weight_block = segment if remainder <= small_size else weight  # not split: the block stays whole
    bias_block = -(-bias // min_block) * min_block
    blocks = 20 * (weight_block + bias_block)
    # this would fail if the rules above did not land on the recipe's printed 'model created' figure
    assert remainder <= small_size and blocks // 1e6 == RECIPE_MB["model created"][0]
    print(f"A weight of {weight:,} B gets a block of {weight_block:,} B ({remainder:,} B left over, under 1 MiB: not "
          f"split); a bias of {bias:,} B gets {bias_block:,} B. 20 layers: {blocks:,} B, {blocks // 1e6:.0f} MB as the "
          f"recipe prints it (// 1e6), its 'model created' figure; the leftovers alone are 20 x {remainder:,} B = "
          f"{20 * remainder / 1e6:.1f} MB.")
    return blocks
