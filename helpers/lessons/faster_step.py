"""Lesson 13 (a faster step): the formulas the runs are checked against, the exercise's check, and pictures.

    from helpers.lessons.faster_step import hook_bytes, hooks_table, check_hook, profile_table, fraction_table

Every measured number comes from a worker's run (helpers/workers/faster_*.py); every number it is compared with
comes from a formula in this file (bytes per hook, FLOPs per step) or from torch in the same run.
"""
from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from helpers import LaunchTimeout, WorkerFailed, launch
from helpers.kit import WORKERS
from helpers.kit.timing import Timing, across_ranks, verdict
from helpers.lessons.checks import announce_run, correct, not_yet, not_yet_crashed

FLOAT32_BYTES = 4
HALF_BYTES = 2
MIN_COMPRESSION_RATE = 2  # PowerSGDState's default (torch/distributed/algorithms/ddp_comm_hooks/powerSGD_hook.py)


# ------------------------------------------------------------------ section 1: bytes each hook hands to all_reduce

def powersgd_split(shapes: Iterable[list[int]], rank: int,
                   min_compression_rate: float = MIN_COMPRESSION_RATE) -> dict[str, int]:
    """Values PowerSGD all-reduces for gradients of these shapes: each gradient seen as a matrix of n rows and m
    columns (a vector is n x 1) is compressed to P (n x r) and Q (m x r), with r = min(n, m, rank), when
    (n + m) r * min_compression_rate < n m; otherwise it is all-reduced as it is (our rebuild of torch's rule,
    _should_compress in powerSGD_hook.py)."""
    split = {"uncompressed": 0, "P": 0, "Q": 0}
    for shape in shapes:
        n, m = shape[0], math.prod(shape[1:]) if len(shape) > 1 else 1
        r = min(n, m, rank)
        if (n + m) * r * min_compression_rate < n * m:
            split["P"] += n * r
            split["Q"] += m * r
        else:
            split["uncompressed"] += n * m
    return split


def hook_bytes(setting: str, shapes: list[list[int]]) -> int:
    """Bytes one step hands to all_reduce under `setting` (one bucket holding every gradient), by the formula:
    fp32 all-reduce 4 bytes per value, fp16/bf16 2, PowerSGD 4 bytes per value of the uncompressed part, P and Q."""
    values = sum(math.prod(shape) for shape in shapes)
    if setting == "all-reduce":
        return FLOAT32_BYTES * values
    if setting in ("fp16", "bf16"):
        return HALF_BYTES * values
    rank = int(re.search(r"r=(\d+)", setting)[1])  # "PowerSGD r=4", "PowerSGD r=4, no feedback"
    return FLOAT32_BYTES * sum(powersgd_split(shapes, rank).values())


def counted_bytes(collectives: list[dict]) -> int:
    """Bytes of one step's all-reduces, as the worker's log recorded them."""
    return sum(event["bytes"] for event in collectives if event["op"] == "all_reduce")


LOSS_STEPS = 5  # the loss read at the end of a run: the mean of its last steps, rank 0's batches


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def hooks_table(run_results: dict[int, dict]) -> dict[str, dict[str, Any]]:
    """Per hook: bytes counted in the last step against the formula, all-reduce calls, the gradient error (median
    over the steps where the hook compressed), the loss at the first step and its mean over the last LOSS_STEPS
    steps, from rank 0; plus whether every rank saw the same bytes."""
    first = run_results[0]
    start = first["start_powersgd"]
    rows = {}
    for name, record in first["record"].items():
        compressing = record["error"][start:] if name.startswith("PowerSGD") else record["error"]
        rows[name] = {
            "counted": counted_bytes(record["collectives"][-1]), "formula": hook_bytes(name, first["shapes"]),
            "calls": sum(e["op"] == "all_reduce" for e in record["collectives"][-1]),
            "other_ops": sorted({e["op"] for step in record["collectives"] for e in step} - {"all_reduce"}),
            "first_step_bytes": counted_bytes(record["collectives"][0]),
            "error": median(compressing), "error_range": (min(compressing), max(compressing)),
            "loss_first": record["loss"][0], "loss_end": sum(record["loss"][-LOSS_STEPS:]) / LOSS_STEPS,
            "same_on_every_rank": all(
                [counted_bytes(s) for s in r["record"][name]["collectives"]] ==
                [counted_bytes(s) for s in record["collectives"]] for r in run_results.values()),
        }
    return rows


def powersgd_values_per_step(run_results: dict[int, dict]) -> dict[str, float]:
    """PowerSGD's own account (PowerSGDState.compression_stats: values before and after compression, summed over every
    compressed step of the run) turned into values all-reduced per step: after x (values per step / before)."""
    first = run_results[0]
    values = sum(math.prod(shape) for shape in first["shapes"])
    return {name: after * values / before for name, (_, before, after) in first["powersgd_stats"].items()}


def hook_timings(run_results: dict[int, dict]) -> dict[str, Timing]:
    """The hooks' step times, each round as slow as its slowest rank."""
    return across_ranks(run_results[rank]["timings"] for rank in sorted(run_results))


def hooks_figure(run_results: dict[int, dict]) -> Any:
    """Three panels from rank 0's record: bytes handed to all_reduce per step (log scale), the gradient error per step
    (log scale; the uncompressed all-reduce's is 0 and is left out), and the loss per step. A control without error
    feedback is dotted, in its twin's colour."""
    import matplotlib.pyplot as plt
    record = run_results[0]["record"]
    _, axes = plt.subplots(1, 3, figsize=(11, 3.3), dpi=80, layout="constrained")
    colours = {base: f"C{index}" for index, base in enumerate(dict.fromkeys(name.split(",")[0] for name in record))}
    for name, steps in record.items():
        style = {"color": colours[name.split(",")[0]], "label": name,
                 "marker": "." if name.startswith("PowerSGD") else None,
                 "linestyle": ":" if "no feedback" in name else "-"}
        axes[0].plot([counted_bytes(c) for c in steps["collectives"]], **style)
        if max(steps["error"]) > 0:
            axes[1].plot(range(len(steps["error"])), [e if e > 0 else float("nan") for e in steps["error"]], **style)
        axes[2].plot(steps["loss"], **style)
    axes[0].set(yscale="log", xlabel="step", ylabel="bytes", title="bytes handed to all_reduce per step")
    axes[1].set(yscale="log", xlabel="step", ylabel="||g - exact|| / ||exact||", title="gradient error")
    axes[2].set(xlabel="step", ylabel="cross-entropy", title="loss (rank 0's batch)")
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.grid(alpha=0.3)
    return axes


# ------------------------------------------------------------------ the exercise: a compression hook of your own

RELATIVE_TOLERANCE = 1e-2  # a 16-bit all-reduce rounds each value to 8 (bfloat16) or 11 (float16) significant bits
CHECK_RANKS = 3  # not 2: a hook that divides by a 2 it wrote down passes on 2 ranks


def check_hook(script: str | Path, timeout: float = 120, nproc: int = CHECK_RANKS) -> bool:
    """Launch faster_hook_check.py with the compress_hook in `script` on `nproc` ranks and decide. Prints Correct
    or Not yet."""
    announce_run(f"{Path(script).name} inside torch's DDP", nproc, timeout, stop_after=30)
    try:
        run = launch(WORKERS / "faster_hook_check.py", nproc=nproc, echo=False, timeout=timeout,
                     args=["--impl", str(Path(script).resolve())])
    except LaunchTimeout:
        return not_yet(f"still running after {timeout:g} s: a collective that one rank never joins?")
    except WorkerFailed as error:
        return not_yet_crashed(error, f"the check of {Path(script).name}")
    checked = {rank: got["checked"][str(Path(script).resolve())] for rank, got in run.results.items()}
    return decide(checked, Path(script).name, run.results[0]["world_size"])


def check_hooks(scripts: list[str | Path], timeout: float = 300, deadline: float = 2,
                nproc: int = CHECK_RANKS) -> dict[str, str]:
    """Several files in one launch (the tests): file name -> the line check_hook would print."""
    args = []
    for script in scripts:
        args += ["--impl", str(Path(script).resolve())]
    run = launch(WORKERS / "faster_hook_check.py", nproc=nproc, echo=False, timeout=timeout,
                 args=[*args, "--deadline", str(deadline)])
    lines = {}
    for script in scripts:
        checked = {rank: got["checked"][str(Path(script).resolve())] for rank, got in run.results.items()}
        lines[Path(script).name] = _verdict_line(checked, Path(script).name, run.results[0]["world_size"])
    return lines


def decide(checked: dict[int, dict], name: str, world_size: int) -> bool:
    """Print Correct or Not yet from every rank's record of one file (faster_hook_check.py's results)."""
    line = _verdict_line(checked, name, world_size)
    return correct(line.removeprefix("Correct: ")) if line.startswith("Correct: ") else not_yet(
        line.removeprefix("Not yet: "))


def _verdict_line(checked: dict[int, dict], name: str, world_size: int) -> str:
    for rank, got in sorted(checked.items()):
        problem = _hook_problem(got, name, world_size)
        if problem:
            return f"Not yet: rank {rank}: {problem}"
    worst = max(step["error"] for got in checked.values() for step in got["steps"])
    others = sorted({step["group_size"] for got in checked.values() for step in got["steps"]
                     if not step["where"].startswith("DDP's default")}, reverse=True)
    groups = "DDP's default group" + (
        f" and on process groups that are not WORLD ({' and '.join(f'{n} rank' + 's' * (n > 1) for n in others)})"
        if others else "")
    return (f"Correct: {name} all-reduced 2 bytes per gradient value (float32 sends 4), one all-reduce per bucket, "
            f"on every rank in every step, and returned the bucket's dtype; DDP's gradients were within {worst:.1e} "
            f"(relative) of the exact average, the rounding of a 16-bit sum, on {world_size} ranks, on {groups}.")


def _hook_problem(got: dict, name: str, world_size: int) -> str | None:
    """The first thing wrong with one rank's record, as the sentence after "rank r: ", or None."""
    if "crashed" in got:  # several files in one launch: the crash was recorded, not raised
        return f"{name} crashed: {got['crashed']}."
    if got["missing"]:
        return f"{name} defines no function compress_hook(process_group, bucket)."
    problem = _future_problem(got["problems"])
    if problem:
        return problem
    for record in got["steps"]:
        problem = _traffic_problem(record)
        if problem:
            group = _group_problem(got["steps"], world_size)
            return f"{problem} And {group}" if group else problem
    for record in got["steps"]:
        problem = _value_problem(record, world_size)
        if problem:
            return problem
    return None


def _group_problem(steps: list[dict], world_size: int) -> str | None:
    """The value problem of a step on a group that is not WORLD, when the steps on DDP's default group had none: a
    hook that ignores the group DDP handed it (the starting code does). Named beside a traffic problem, which comes
    first."""
    default = [record for record in steps if record["where"].startswith("DDP's default")]
    if any(_value_problem(record, world_size) for record in default):
        return None
    return next((problem for record in steps if not record["where"].startswith("DDP's default")
                 for problem in [_value_problem(record, world_size)] if problem), None)


def _value_problem(record: dict, world_size: int) -> str | None:
    """What is wrong with the gradients DDP kept, named by what they are closest to."""
    if record["error"] <= RELATIVE_TOLERANCE:
        return None
    size, where = record["group_size"], f"in step {record['step']} on {record['where']}"
    if record["every_rank_fit"] < RELATIVE_TOLERANCE and record["every_rank_differs"] > RELATIVE_TOLERANCE:
        # catches an all-reduce on the default group when DDP was given another one
        return (f"{where}, DDP's gradients are (a multiple of) the average over all {world_size} ranks, not over "
                f"the {size} rank{'s' if size > 1 else ''} of the group DDP handed your hook: all-reduce on "
                "process_group (dist.group.WORLD only when it is None) and divide by that group's size.")
    if size > 1 and record["own_fit"] < RELATIVE_TOLERANCE:  # catches a result that never used the all-reduce
        return (f"{where}, DDP's gradients are this rank's own gradients, scaled, not the all-reduced sum: the "
                "callback must build its result from the all-reduce's value, done.value()[0], not from the bucket "
                "it was given.")
    if record["ratio"] > 0:
        divisor = size / record["ratio"]  # the sum is size x the average: what the sum was divided by
        whole = round(divisor)
        if whole >= 1 and whole != size and abs(divisor - whole) < 0.05 * divisor:
            return _division_problem(where, record["ratio"], whole, size, world_size)
    return (f"{where}, DDP's gradients differ from the exact average of the group's gradients by "
            f"{record['error']:.2g} (relative), more than a 16-bit all-reduce's rounding ({RELATIVE_TOLERANCE:g}).")


def _division_problem(where: str, ratio: float, divisor: int, size: int, world_size: int) -> str:
    if divisor == 1:  # catches a sum not divided at all
        return (f"{where}, DDP's gradients were {ratio:.2f} times the exact average: divide the all-reduced sum by "
                f"the number of ranks in the group ({size}).")
    if divisor == size * size:  # catches a division made twice
        return (f"{where}, DDP's gradients were {ratio:.2f} times the exact average (1/{size}): the sum was divided "
                "by the number of ranks twice.")
    if divisor == world_size:  # catches dist.get_world_size() with a group of fewer ranks
        return (f"{where}, the all-reduced sum was divided by {divisor}, every rank's count "
                f"(dist.get_world_size()); the group DDP handed your hook has {size}: divide by group.size().")
    return (f"{where}, the all-reduced sum was divided by {divisor}, but the group has {size} "
            f"rank{'s' if size > 1 else ''}: divide by the group's size, group.size(), not a number written down.")


def _future_problem(problems: list[dict]) -> str | None:
    if not problems:
        return None
    first = problems[0]
    kind = first["kind"]
    if kind == "torch's hook":  # catches `return fp16_compress_hook(process_group, bucket)`
        return (f"compress_hook let torch's own hook issue the all-reduce ({first['function']}, in "
                "torch/distributed/algorithms/ddp_comm_hooks/). That is the right call in a training script "
                "(section 1 registers it), but here the exercise is to write the cast, the all-reduce and the "
                "callback yourself; the check would grade torch's code, not yours.")
    if kind == "not a future":
        return (f"compress_hook returned a {first['type']}, not a torch.futures.Future: return the all-reduce's "
                "future (dist.all_reduce(..., async_op=True).get_future()) chained with .then(...).")
    if kind == "unfinished":
        return (f"the future compress_hook returned was still not complete {first['deadline']:g} s later: a Future "
                "you create yourself (torch.futures.Future()) waits until someone calls set_result; return the "
                "all-reduce's own future, chained with .then(...), instead.")
    if kind == "failed future":  # catches an error in the learner's .then callback
        place = f" at {first['where']}" if first["where"] else ""
        return f"the callback of the future compress_hook returned raised {first['error']}{place}."
    if kind == "not a tensor" and first["type"] == "NoneType":  # catches a callback without `return`
        return ("your callback returned None, so the future compress_hook returned holds None: end the callback "
                "with `return` and the tensor DDP should use (the sum cast back and divided).")
    if kind == "not a tensor":
        return (f"compress_hook's future holds a {first['type']}, not one tensor: the future of "
                "dist.all_reduce(...).get_future() holds a list ([tensor]); chain .then(lambda f: f.value()[0] ...) "
                "and return that tensor, cast back and divided.")
    if kind == "shape":
        return (f"compress_hook's future holds a tensor of shape {first['shape']}; DDP needs the bucket's shape "
                f"{first['bucket_shape']}.")
    if kind == "dtype":  # DDP copies any dtype into the gradients, but the exercise asks to cast back
        return (f"compress_hook's future holds {first['dtype']} values: cast the sum back to the bucket's dtype "
                f"({first['bucket_dtype']}) before returning it, as torch's own fp16 and bf16 hooks do (in this run "
                "DDP copied your values into the float32 gradients anyway, at a 16-bit precision).")
    return f"{kind}: {first}"


def _traffic_problem(record: dict) -> str | None:
    buckets, calls, step = record["buckets"], record["calls"], record["step"]
    ops = sorted({call["op"] for call in calls} - {"all_reduce"})
    if ops:  # catches a broadcast or all-gather in a hook that should all-reduce
        return f"in step {step} compress_hook called {ops}; a compression hook needs one all-reduce per bucket."
    if len(calls) != len(buckets):  # catches an all-reduce issued twice, or none
        unseen = (" (the check sees only calls made as dist.all_reduce, torch.distributed's attribute; one made "
                  "through distributed_c10d, the group object or _functional_collectives is not counted)"
                  ) if not calls else ""
        return (f"in step {step} compress_hook issued {len(calls)} all-reduce calls for {len(buckets)} "
                f"bucket{'s' if len(buckets) > 1 else ''}: one all-reduce per bucket{unseen}.")
    values = sum(bucket["values"] for bucket in buckets)
    sent = sum(call["bytes"] for call in calls)
    if sent != HALF_BYTES * values:  # catches an all-reduce in float32 (no compression), or in 8 bits
        return (f"in step {step} compress_hook handed {sent / values:g} bytes per gradient value to all_reduce "
                f"({sent} bytes for {values} values): cast the bucket to torch.float16 or torch.bfloat16 (2 bytes "
                "each) before the all-reduce.")
    return None


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------ sections 3-4: torch.compile with DDP and FSDP2

def split_table(compile_results: dict) -> list[dict[str, Any]]:
    """Per bucket setting: the parameter bytes of each graph dynamo made, torch's own log line, and the buckets DDP's
    reducer all-reduced in the same compiled run (its last step)."""
    rows = []
    for setting, split in compile_results["splits"].items():
        log = split["torch_log"][0] if split["torch_log"] else ""
        rows.append({"setting": setting, "graphs": [g["parameter_bytes"] for g in split["graphs"]],
                     "torch_says": log.split(". Enable")[0], "ddp_buckets": split["ddp_buckets"]})
    return rows


def print_split_table(compile_results: dict) -> None:
    for row in split_table(compile_results):
        print(f"{row['setting']:<31} {len(row['graphs'])} graphs, parameter bytes per graph {row['graphs']}\n"
              f"{'':<31} torch's log: {row['torch_says']!r}\n"
              f"{'':<31} DDP's reducer all-reduced buckets of {row['ddp_buckets']} bytes")


def split_figure(compile_results: dict) -> Any:
    """One row per bucket setting: the model's parameters (front to back) cut into the graphs dynamo compiled."""
    import matplotlib.pyplot as plt
    rows = split_table(compile_results)
    _, ax = plt.subplots(figsize=(8, 0.7 + 0.6 * len(rows)), dpi=80, layout="constrained")
    for y, row in enumerate(rows):
        left = 0.0
        for index, size in enumerate(row["graphs"]):
            ax.barh(y, size / 2**20, left=left, color=f"C{index}", edgecolor="white")
            last = index == len(row["graphs"]) - 1  # DDPOptimizer's first bucket: it walks from the last layer back
            ax.text(left + size / 2**21, y, f"graph {index + 1}" + ("\nlast layers" if last else ""), ha="center",
                    va="center", fontsize=8, color="white")
            left += size / 2**20
    ax.set(yticks=range(len(rows)), yticklabels=[f"bucket_cap_mb: {r['setting']}" for r in rows],
           xlabel="MiB of parameters: first layer on the left, last layers (DDPOptimizer's first bucket) on the right",
           title="The graphs torch.compile made of the DDP model")
    ax.invert_yaxis()
    return ax


def fsdp_table(fsdp_results: dict) -> None:
    """Per way of running FSDP2: graphs compiled, collectives of the last step, difference from eager."""
    for how, run in fsdp_results["runs"].items():
        last = run["steps"][-1]
        ops = {}
        for event in last:
            ops[event["op"]] = ops.get(event["op"], 0) + 1
        graphs = [g["parameter_bytes"] for g in run["graphs"]]
        print(f"{how:<26} graphs {len(graphs)} (parameter bytes {graphs}); last step: "
              f"{', '.join(f'{n} x {op}' for op, n in sorted(ops.items()))}, {sum(e['bytes'] for e in last):,} "
              f"bytes; gradient shards differ from eager by {run['max_difference']:.1g}")


# ------------------------------------------------------------------ section 5: the profiler's trace file

DTYPE_BYTES = {"float": 4, "c10::Half": 2, "c10::BFloat16": 2, "double": 8}  # the trace's "Input type" names


def _kind(name: str) -> str | None:
    """Lesson 03's three rows, by the profiler's event names (helpers/workers/dp_vs_ddp_overlap.py, kind_of)."""
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name == "c10d::allreduce_":
        return "all-reduce issued"
    if name.startswith("gloo:all_reduce"):
        return "all-reduce running"
    return None


def _bytes(event: dict) -> int:
    """Bytes of the tensor a gloo:all_reduce event carried, from the trace's own record of its input (record_shapes):
    "Input Dims" [[n]] and "Input type" ["c10::Half"]."""
    args = event.get("args", {})
    dims, types = args.get("Input Dims") or [[]], args.get("Input type") or [""]
    return math.prod(dims[0]) * DTYPE_BYTES.get(types[0], 0)


def trace_steps(path: str | Path, setting: str) -> list[list[dict]]:
    """The events of each step of `setting` in a Chrome trace that torch.profiler exported, in lesson 03's form:
    kind, thread, start_us and end_us from the start of that step's first backward op, and for gloo's all-reduces the
    bytes they carried. A running all-reduce belongs to the step it started in (its wait may end after the mark)."""
    events = [e for e in read_json(path)["traceEvents"] if e.get("ph") == "X"]
    marks = sorted((e for e in events if e["name"] == f"{setting} step"), key=lambda e: e["ts"])
    steps = []
    for mark in marks:
        begin, end = mark["ts"], mark["ts"] + mark["dur"]
        found = [{"name": e["name"], "kind": _kind(e["name"]), "thread": e["tid"], "start_us": e["ts"],
                  "end_us": e["ts"] + e["dur"], "bytes": _bytes(e) if _kind(e["name"]) == "all-reduce running" else 0}
                 for e in events if _kind(e["name"]) and begin <= e["ts"] <= end]
        first = min(e["start_us"] for e in found if e["kind"] == "backward")
        for e in found:
            e["start_us"], e["end_us"] = e["start_us"] - first, e["end_us"] - first
        steps.append(sorted(found, key=lambda e: e["start_us"]))
    return steps


def profile_table(profile_results: dict) -> dict[str, dict[str, Any]]:
    """Per setting, from the trace file: lesson 03's issue_order of each profiled step, the bytes gloo's all-reduces
    carried per step (the trace's own record), the threads they ran on, and the backward's span in the trace; beside
    them, from the worker's clocks, the backward's wall time and the training thread's CPU time (medians)."""
    from helpers.lessons.dp_vs_ddp import issue_order  # imports torch: only when this section runs
    table = {}
    for setting in profile_results["settings"]:
        steps = trace_steps(profile_results["trace"], setting)
        clocks = profile_results["backward"][setting]
        table[setting] = {
            "order": [issue_order(events) for events in steps],
            "bytes": [sum(e["bytes"] for e in events if e["kind"] == "all-reduce running") for events in steps],
            "running_threads": sorted({e["thread"] for events in steps for e in events
                                       if e["kind"] == "all-reduce running"}),
            "backward_threads": sorted({e["thread"] for events in steps for e in events if e["kind"] == "backward"}),
            "backward_span_ms": median([max(e["end_us"] for e in events if e["kind"] == "backward") / 1000
                                        for events in steps]),
            "wall_ms": 1000 * median(clocks["wall"]), "cpu_ms": 1000 * median(clocks["cpu"]),
        }
    return table


def timeline_figure(profile_results: dict, step: int, settings: tuple[str, ...] = ("4 buckets", "1 bucket")) -> Any:
    """One profiled step of each setting, drawn from the trace file: the backward's ops on the training thread (less
    the calls that issue the all-reduces), those calls, and gloo's all-reduce on its threads (waiting included)."""
    import matplotlib.pyplot as plt

    from helpers.lessons.dp_vs_ddp import subtract  # imports torch: only when this section runs

    def spans(events, kind):
        return [(e["start_us"] / 1000, e["end_us"] / 1000) for e in events if e["kind"] == kind]

    rows = {}
    for setting in settings:
        events = trace_steps(profile_results["trace"], setting)[step]
        rows[f"{setting}: backward ops"] = subtract(spans(events, "backward"), spans(events, "all-reduce issued"))
        rows[f"{setting}: all-reduce issued"] = spans(events, "all-reduce issued")
        rows[f"{setting}: gloo:all_reduce"] = spans(events, "all-reduce running")
    _, ax = plt.subplots(figsize=(9, 0.6 + 0.45 * len(rows)), dpi=80, layout="constrained")
    for row, found in enumerate(rows.values()):
        ax.broken_barh([(s, max(e - s, 0.03)) for s, e in found], (row - 0.35, 0.7), color=f"C{row % 3}")
    ax.set(yticks=range(len(rows)), yticklabels=list(rows), xlabel="ms since this step's backward started (wall clock)",
           title="torch.profiler's trace file, rank 0: one DDP step per setting")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    return ax


# ------------------------------------------------------------------ section 6: a measured matmul rate

def flops_formula(layers: list[list[int]], batch: int) -> dict[str, int]:
    """Matmul FLOPs of one forward and backward of a stack of Linear layers (2 per multiply-add): the forward, the
    weight gradients, and the input gradients of every layer but the first (its input needs none)."""
    products = [inputs * outputs for inputs, outputs in layers]
    return {"forward": 2 * batch * sum(products), "weight gradients": 2 * batch * sum(products),
            "input gradients": 2 * batch * sum(products[1:])}


def matmul_rates(mfu_results: dict[int, dict]) -> dict[int, Timing]:
    """Each size's matmul timings, a round as slow as the slower rank."""
    timings = across_ranks(mfu_results[rank]["matmul"] for rank in sorted(mfu_results))
    return {int(name): timing for name, timing in timings.items()}


def fraction_table(mfu_results: dict[int, dict]) -> dict[str, Any]:
    """FLOPs per step and rank; each size's matmul rate per rank (a turn's 2 n^3 FLOPs per product over the median
    round, and over the slowest and fastest rounds); the step times; and the fraction of the best size's median rate
    a DDP step reached, with the range it spans over that size's rounds. Not MFU: MFU divides by the hardware's
    published peak."""
    first = mfu_results[0]
    rates = {}
    for n, timing in matmul_rates(mfu_results).items():
        flops = 2 * n**3 * first["matmul_calls"][str(n)]  # a turn's products (JSON keys are strings)
        low, high = timing.spread()
        rates[n] = {"median": flops / timing.median(), "low": flops / high, "high": flops / low}
    best = max(rates, key=lambda n: rates[n]["median"])
    steps = across_ranks(mfu_results[rank]["steps"] for rank in sorted(mfu_results))
    achieved = first["flops"] / steps["DDP step"].median()
    return {"flops": first["flops"], "rates": rates, "best_size": best, "achieved": achieved,
            "fraction": achieved / rates[best]["median"],
            "fraction_range": (achieved / rates[best]["high"], achieved / rates[best]["low"]), "steps": steps,
            "verdicts": {kind: verdict(steps["DDP step"], steps["no all-reduce (no_sync)"], kind=kind)
                         for kind in ("wall", "cpu")}}


# ------------------------------------------------------------------ the closing note

def closing_note(hooks: dict, compiled: dict, fsdp: dict, profiled: dict | None, mfu: dict) -> None:
    """The numbers the lesson ends on, each from this run, with the timing protocol's verdicts (wall time, and CPU
    time of the ranks together) where a time is read. `profiled` is None where section 5 was skipped (CUDA)."""
    table, timings = hooks_table(hooks), hook_timings(hooks)
    print("Bytes per step handed to all_reduce (counted / formula), and the step time against float32's:")
    for name, row in table.items():
        timed = f"; {_short(timings[name], timings['all-reduce'])}" if name in timings and name != "all-reduce" else ""
        print(f"  {name:<25} {row['counted']:>9,} / {row['formula']:>9,}{timed}")
    print("Gradient error, median over the compressed steps: " + ", ".join(
        f"{name} {row['error']:.2g}" for name, row in table.items() if name.startswith("PowerSGD")))
    splits = compiled[0]["splits"]
    print("Graphs per bucket setting under torch.compile(DDP): " + ", ".join(
        f"{setting}: {len(split['graphs'])}" for setting, split in splits.items())
        + f"; FSDP2 with each block compiled: {len(fsdp[0]['runs']['each block compiled']['graphs'])}")
    inductor = compiled[0]["inductor"]
    if "skipped" in inductor:
        print("Inductor: skipped (no C++ compiler).")
    else:
        steps = across_ranks(compiled[rank]["inductor"]["timings"] for rank in sorted(compiled))
        print(f"Inductor: first step {inductor['cold_first_step_s']:.1f} s with an empty cache (rank 0 alone), "
              f"{inductor['warm_first_step_s']:.1f} s with it filled (one sample each); "
              f"{_short(steps['compiled'], steps['eager'])}")
    if profiled is not None:
        print("The profiler's trace file: the first all-reduce issued with " + "; ".join(
            f"{median([o['ops_after_first_issue'] for o in row['order']])} of {row['order'][0]['ops']} backward ops "
            f"to run ({setting})" for setting, row in profile_table(profiled).items()))
    result = fraction_table(mfu)
    low, high = result["fraction_range"]
    print(f"A DDP step reached {result['fraction']:.0%} ({low:.0%}-{high:.0%}) of a measured matmul rate of "
          f"{result['rates'][result['best_size']]['median'] / 1e9:.1f} GFLOP/s per rank "
          f"({result['flops'] / 1e6:.0f} MFLOP per step and rank); "
          f"{_short(result['steps']['DDP step'], result['steps']['no all-reduce (no_sync)'])}")


def _short(first: Timing, second: Timing) -> str:
    """Both verdicts' first clauses: who is faster by how much, or not distinguishable; wall, then CPU."""
    said = []
    for kind in ("wall", "cpu"):
        found = verdict(first, second, kind=kind)
        what = "wall" if kind == "wall" else f"CPU of {max(first.ranks, second.ranks)} ranks"
        done = "faster" if kind == "wall" else "uses less CPU"  # CPU time is work done, not a step's duration
        said.append(f"{found.faster} {done}, {found.ratio:.2f}x ({what})" if found.distinguishable
                    else f"not distinguishable ({what})")
    return f"{first.name} against {second.name}: " + "; ".join(said)
