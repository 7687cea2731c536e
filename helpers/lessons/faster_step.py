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
from helpers.lessons.checks import correct, not_yet, not_yet_crashed

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
    rank = int(setting.rsplit(" ", 1)[-1])
    return FLOAT32_BYTES * sum(powersgd_split(shapes, rank).values())


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


def hook_timings(run_results: dict[int, dict]) -> dict[str, Timing]:
    """The hooks' step times, each round as slow as its slowest rank."""
    return across_ranks(run_results[rank]["timings"] for rank in sorted(run_results))


# ------------------------------------------------------------------ the exercise: a compression hook of your own

RELATIVE_TOLERANCE = 1e-2  # a 16-bit all-reduce rounds each value to 8 (bfloat16) or 11 (float16) significant bits


def check_hook(script: str | Path, timeout: float = 120, nproc: int = 2) -> bool:
    """Launch faster_hook_check.py with the compress_hook in `script` on `nproc` ranks and decide. Prints Correct
    or Not yet."""
    print(f"Running your hook inside torch's DDP on {nproc} ranks (usually under 10 s; the check gives up after "
          f"{timeout:g} s).", flush=True)
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
