"""Lesson 13 (a faster step): the formulas the runs are checked against, the exercise's check, and pictures.

    from helpers.lessons.faster_step import hook_bytes, hooks_table, check_hook, trace_spans, mfu_table

Every measured number comes from a worker's run (helpers/workers/faster_*.py); every number it is compared with
comes from a formula in this file (bytes per hook, FLOPs per step) or from torch in the same run.
"""
from __future__ import annotations

import json
import math
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
    return FLOAT32_BYTES * sum(powersgd_split(shapes, int(setting.split("r=")[-1])).values())


def counted_bytes(collectives: list[dict]) -> int:
    """Bytes of one step's all-reduces, as the worker's log recorded them."""
    return sum(event["bytes"] for event in collectives if event["op"] == "all_reduce")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def hooks_table(run_results: dict[int, dict]) -> dict[str, dict[str, Any]]:
    """Per hook: bytes counted in the last step against the formula, all-reduce calls, the gradient error (median
    over the steps where the hook compressed) and the loss at the first and last step, from rank 0; plus whether
    every rank saw the same bytes and errors."""
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
            "loss_first": record["loss"][0], "loss_last": record["loss"][-1],
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
    (log scale; the uncompressed all-reduce's is 0 and is left out), and the loss per step."""
    import matplotlib.pyplot as plt
    record = run_results[0]["record"]
    _, axes = plt.subplots(1, 3, figsize=(11, 3.3), dpi=80, layout="constrained")
    for index, (name, steps) in enumerate(record.items()):
        style = {"color": f"C{index}", "label": name, "marker": "." if name.startswith("PowerSGD") else None}
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


def check_hook(script: str | Path, timeout: float = 120, nproc: int = 2) -> bool:
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


def check_hooks(scripts: list[str | Path], timeout: float = 300, deadline: float = 2) -> dict[str, str]:
    """Several files in one launch (the tests): file name -> the line check_hook would print."""
    args = []
    for script in scripts:
        args += ["--impl", str(Path(script).resolve())]
    run = launch(WORKERS / "faster_hook_check.py", nproc=2, echo=False, timeout=timeout,
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
    return (f"Correct: {name} all-reduced 2 bytes per gradient value (float32 sends 4), one all-reduce per bucket, "
            f"on every rank in every step, and returned the bucket's dtype; DDP's gradients were within {worst:.1e} "
            f"(relative) of the exact average, the rounding of a 16-bit sum.")


def _hook_problem(got: dict, name: str, world_size: int) -> str | None:
    """The first thing wrong with one rank's record, as the sentence after "rank r: ", or None."""
    if "crashed" in got:  # several files in one launch: the crash was recorded, not raised
        return f"{name} crashed: {got['crashed']}."
    if got["missing"]:
        return f"{name} defines no function compress_hook(process_group, bucket)."
    problem = _future_problem(got["problems"])
    if problem:
        return problem
    for step, record in enumerate(got["steps"]):
        problem = _traffic_problem(step, record)
        if problem:
            return problem
    for step, record in enumerate(got["steps"]):
        if abs(record["ratio"] - world_size) < 0.05 * world_size:  # catches a sum not divided by the world size
            return (f"in step {step} DDP's gradients were {record['ratio']:.2f} times the exact average: divide the "
                    f"all-reduced sum by the number of ranks ({world_size}).")
        if abs(record["ratio"] - 1 / world_size) < 0.05 / world_size:  # catches a division made twice
            return (f"in step {step} DDP's gradients were {record['ratio']:.2f} times the exact average "
                    f"(1/{world_size}): the sum was divided by the number of ranks twice.")
        if record["error"] > RELATIVE_TOLERANCE:  # catches a lost bucket, a local gradient kept, a wrong cast
            return (f"in step {step} DDP's gradients differ from the exact average of the ranks' gradients by "
                    f"{record['error']:.2g} (relative), more than a 16-bit all-reduce's rounding "
                    f"({RELATIVE_TOLERANCE:g}).")
    return None


def _future_problem(problems: list[dict]) -> str | None:
    if not problems:
        return None
    first = problems[0]
    kind = first["kind"]
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


def _traffic_problem(step: int, record: dict) -> str | None:
    buckets, calls = record["buckets"], record["calls"]
    ops = sorted({call["op"] for call in calls} - {"all_reduce"})
    if ops:  # catches a broadcast or all-gather in a hook that should all-reduce
        return f"in step {step} compress_hook called {ops}; a compression hook needs one all-reduce per bucket."
    if len(calls) != len(buckets):  # catches an all-reduce issued twice, or none
        return (f"in step {step} compress_hook issued {len(calls)} all-reduce calls for {len(buckets)} "
                f"bucket{'s' if len(buckets) > 1 else ''}: one all-reduce per bucket.")
    values = sum(bucket["values"] for bucket in buckets)
    sent = sum(call["bytes"] for call in calls)
    if sent != HALF_BYTES * values:  # catches an all-reduce in float32 (no compression), or in 8 bits
        return (f"in step {step} compress_hook handed {sent / values:g} bytes per gradient value to all_reduce "
                f"({sent} bytes for {values} values): cast the bucket to torch.float16 or torch.bfloat16 (2 bytes "
                "each) before the all-reduce.")
    return None


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text())


# ------------------------------------------------------------------ sections 2-3: torch.compile with DDP and FSDP2

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
            ax.text(left + size / 2**21, y, f"graph {index + 1}", ha="center", va="center", fontsize=8, color="white")
            left += size / 2**20
    ax.set(yticks=range(len(rows)), yticklabels=[f"bucket_cap_mb: {r['setting']}" for r in rows],
           xlabel="MiB of parameters, first layer on the left", title="The graphs torch.compile made of the DDP model")
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
        print(f"{how:<22} graphs {len(graphs)} (parameter bytes {graphs}); last step: "
              f"{', '.join(f'{n} x {op}' for op, n in sorted(ops.items()))}, {sum(e['bytes'] for e in last):,} "
              f"bytes; gradient shards differ from eager by {run['max_difference']:.1g}")


# ------------------------------------------------------------------ section 4: the profiler's timeline

def _kind(name: str) -> str | None:
    """Lesson 03's three rows, by the profiler's event names (helpers/workers/dp_vs_ddp_overlap.py, kind_of)."""
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name == "c10d::allreduce_":
        return "all-reduce issued"
    if name.startswith("gloo:all_reduce"):
        return "all-reduce running"
    return None


def trace_steps(path: str | Path, setting: str) -> list[list[dict]]:
    """The events of each step of `setting` in a Chrome trace that torch.profiler exported, in lesson 03's form:
    kind, thread, start_us and end_us from the start of that step's first backward op. A running all-reduce
    belongs to the step it started in (its wait may end after the step's mark)."""
    events = [e for e in read_json(path)["traceEvents"] if e.get("ph") == "X"]
    marks = sorted((e for e in events if e["name"] == f"{setting} step"), key=lambda e: e["ts"])
    steps = []
    for mark in marks:
        begin, end = mark["ts"], mark["ts"] + mark["dur"]
        found = [{"name": e["name"], "kind": _kind(e["name"]), "thread": e["tid"], "start_us": e["ts"],
                  "end_us": e["ts"] + e["dur"]} for e in events if _kind(e["name"]) and begin <= e["ts"] <= end]
        first = min(e["start_us"] for e in found if e["kind"] == "backward")
        for e in found:
            e["start_us"], e["end_us"] = e["start_us"] - first, e["end_us"] - first
        steps.append(sorted(found, key=lambda e: e["start_us"]))
    return steps


def hook_events(hook_step: dict) -> list[dict]:
    """One step as our comm hook saw it, in the same form: compute from the backward call to the last bucket's hook
    call (its gradients are the last ones), each bucket issued while the hook ran, and running from the hook's return
    to the moment its future completed (which needs the GIL: a Python callback runs it)."""
    zero = hook_step["backward_called"]

    def us(seconds: float) -> float:
        return (seconds - zero) * 1e6

    buckets = hook_step["buckets"]
    events = [{"kind": "backward", "start_us": 0.0, "end_us": us(max(b["called"] for b in buckets))}]
    for bucket in buckets:
        events.append({"kind": "all-reduce issued", "start_us": us(bucket["called"]), "end_us": us(bucket["returned"])})
        events.append({"kind": "all-reduce running", "start_us": us(bucket["returned"]),
                       "end_us": us(bucket["completed"])})
    return events


def overlap(events: list[dict]) -> dict[str, float]:
    """How much of one step's running all-reduce time falls inside backward compute.

    compute: the backward ops on the training thread, minus the all-reduce calls issued from inside them;
    communication: the all-reduce running in the backend's thread (with gloo this includes waiting for the
    other ranks). fraction = |communication and compute at the same time| / |communication|.
    """
    from helpers.lessons.dp_vs_ddp import intersect, subtract, total  # imports torch: only when this section runs

    def spans(kind: str) -> list[tuple[float, float]]:
        return [(e["start_us"], e["end_us"]) for e in events if e["kind"] == kind]

    compute = subtract(spans("backward"), spans("all-reduce issued"))
    communication = spans("all-reduce running")
    backward_end = max(end for _, end in spans("backward"))
    both = total(intersect(communication, compute))
    comm = total(communication)
    return {"communication_us": comm, "compute_us": total(compute), "overlap_us": both,
            "fraction": both / comm if comm else 0.0, "backward_us": backward_end,
            "communication_after_backward_us": total(subtract(communication, [(float("-inf"), backward_end)]))}


def overlaps(profile_results: dict) -> dict[str, list[dict[str, float]]]:
    """overlap() on three sources of the same launch: the trace's plain steps (lesson 03's setting), the trace's
    hooked steps, and our hook's record of those hooked steps."""
    trace = profile_results["trace"]
    return {"profiler, plain steps (lesson 03's setting)": [overlap(s) for s in trace_steps(trace, "plain")],
            "profiler, hooked steps": [overlap(s) for s in trace_steps(trace, "hooked")],
            "our hook, the same hooked steps": [overlap(hook_events(s)) for s in profile_results["hook_steps"]]}


def timeline_figure(profile_results: dict, step: int) -> Any:
    """One hooked step drawn twice: from torch's events in the trace file, and from our hook's timestamps."""
    import matplotlib.pyplot as plt

    from helpers.lessons.dp_vs_ddp import subtract
    traced = trace_steps(profile_results["trace"], "hooked")[step]
    ours = hook_events(profile_results["hook_steps"][step])

    def spans(events, kind):
        return [(e["start_us"] / 1000, e["end_us"] / 1000) for e in events if e["kind"] == kind]

    rows = {
        "profiler: backward compute": subtract(spans(traced, "backward"), spans(traced, "all-reduce issued")),
        "profiler: all-reduce issued": spans(traced, "all-reduce issued"),
        "profiler: gloo:all_reduce": spans(traced, "all-reduce running"),
        "our hook: backward to last hook": spans(ours, "backward"),
        "our hook: issued": spans(ours, "all-reduce issued"),
        "our hook: running until callback": spans(ours, "all-reduce running"),
    }
    _, ax = plt.subplots(figsize=(9, 3.2), dpi=80, layout="constrained")
    for row, found in enumerate(rows.values()):
        ax.broken_barh([(s, max(e - s, 0.03)) for s, e in found], (row - 0.35, 0.7), color=f"C{row // 3}")
    ax.set(yticks=range(len(rows)), yticklabels=list(rows), xlabel="ms since this step's backward started",
           title="One DDP step with our hook, rank 0: torch's profiler (blue) and our hook's clock (orange)")
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
    return ax


# ------------------------------------------------------------------ section 5: model FLOPs utilisation

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


def mfu_table(mfu_results: dict[int, dict]) -> dict[str, Any]:
    """FLOPs per step, the best measured matmul rate (per rank, both ranks computing), step times and the fraction."""
    first = mfu_results[0]
    rates = {n: 2 * n**3 / timing.median() for n, timing in matmul_rates(mfu_results).items()}
    peak_size = max(rates, key=rates.get)
    steps = across_ranks(mfu_results[rank]["steps"] for rank in sorted(mfu_results))
    table = {"flops": first["flops"], "rates": rates, "peak": rates[peak_size], "peak_size": peak_size,
             "steps": steps, "verdict": verdict(steps["DDP step"], steps["no all-reduce (no_sync)"])}
    table["mfu"] = {name: first["flops"] / timing.median() / table["peak"] for name, timing in steps.items()}
    return table


# ------------------------------------------------------------------ the closing note

def closing_note(hooks: dict, compiled: dict, fsdp: dict, profiled: dict, mfu: dict) -> None:
    """The numbers the lesson ends on, each from this run, with the timing protocol's verdict where a time is read."""
    table, timings = hooks_table(hooks), hook_timings(hooks)
    print("Bytes per step handed to all_reduce (counted / formula), and the step time against float32's:")
    for name, row in table.items():
        timed = "" if name == "all-reduce" else f"; {_short(verdict(timings[name], timings['all-reduce']))}"
        print(f"  {name:<14} {row['counted']:>9,} / {row['formula']:>9,}{timed}")
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
        timed = _short(verdict(steps["compiled"], steps["eager"]))
        print(f"Inductor: first step {inductor['cold_first_step_s']:.1f} s with an empty cache, "
              f"{inductor['warm_first_step_s']:.1f} s with it filled; {timed}")
    found = overlaps(profiled)
    print("All-reduce span during backward compute, median of 3 steps (lesson 03's measure): " + "; ".join(
        f"{source} {median([o['fraction'] for o in steps]):.0%}" for source, steps in found.items()))
    result = mfu_table(mfu)
    print(f"MFU: {result['mfu']['DDP step']:.0%} of a measured {result['peak'] / 1e9:.0f} GFLOP/s per rank "
          f"({result['flops'] / 1e6:.0f} MFLOP per step and rank); {_short(result['verdict'])}")


def _short(found) -> str:
    """A verdict's first clause: who is faster by how much, or not distinguishable."""
    if found.distinguishable:
        return f"{found.faster} faster than {found.slower}, {found.ratio:.2f}x (wall)"
    return f"{found.sentence.split(':')[0]}: not distinguishable (wall)"
