"""Pictures and arithmetic for lesson 01 (collectives): what every rank held, and what bytes cost.

    from helpers.lessons.collectives import draw_collectives, draw_barrier, bandwidth_rows, fit_latency_bandwidth
    draw_collectives(run, ["broadcast", "all_reduce"])   # run of helpers/workers/collectives_tour.py
    latency, bandwidth = fit_latency_bandwidth(sizes, seconds)          # a 2-rank sweep
    predict_allreduce_seconds(64 * 2**20, 8, latency, bandwidth)        # the ring model for 8 ranks
    check_all_gather("my_all_gather.py")                 # the lesson's exercise

Taught in notebooks/01_collectives.ipynb.
"""
from __future__ import annotations

import ast
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.patches import Rectangle

from helpers.kit import WORKERS
from helpers.launcher.api import LaunchTimeout, Run, WorkerFailed, launch
from helpers.lessons.checks import announce_run, correct, each_rank, not_yet, not_yet_crashed

RANK_COLOURS = plt.get_cmap("tab10").colors
COMBINED_COLOUR = "0.75"  # a number made by adding several ranks' numbers
CHECK_HARNESS = WORKERS / "collectives_all_gather_check.py"


def tensors(run: Run, operation: str) -> tuple[list[list[float]], list[list[float]]]:
    """Every rank's tensor before and after `operation`, in rank order (from collectives_tour.py)."""
    ranks = sorted(run.results)
    before = [run.results[rank]["tensors"][operation]["before"] for rank in ranks]
    after = [run.results[rank]["tensors"][operation]["after"] for rank in ranks]
    return before, after


def owner(value: float, world_size: int, length: int) -> int | None:
    """The rank whose starting tensor holds `value` (10r+1 .. 10r+length), None for a combined number."""
    rank, offset = divmod(int(value) - 1, 10)
    return rank if value == int(value) and 0 <= rank < world_size and offset < length else None


def _draw_row(ax: plt.Axes, values: Sequence[float], x0: float, y: float, world_size: int,
              length: int, faded: bool) -> None:
    for column, value in enumerate(values):
        source = owner(value, world_size, length)
        colour = COMBINED_COLOUR if source is None else RANK_COLOURS[source % 10]
        ax.add_patch(Rectangle((x0 + column, y), 0.95, 0.8, facecolor=colour,
                               alpha=0.25 if faded else 0.75, edgecolor="black", linewidth=0.5))
        ax.text(x0 + column + 0.47, y + 0.4, f"{value:g}", ha="center", va="center", fontsize=8,
                color="0.5" if faded else "black")


def draw_collective(run: Run, operation: str, ax: plt.Axes | None = None,
                    unspecified: Sequence[int] = (), combined: bool = False) -> plt.Axes:
    """Rows = ranks; left: the tensor before, right: after. Colour = the rank a number came from
    (grey: a sum of several ranks). Ranks in `unspecified` hold values the API does not promise.
    `combined`: every number after the operation is a sum, even one that looks like a rank's own (12 = 1 + 11)."""
    before, after = tensors(run, operation)
    world_size, length = len(before), max(len(row) for row in before)
    if ax is None:
        _, ax = plt.subplots(figsize=(5, 0.5 + 0.45 * world_size), dpi=80, layout="constrained")
    right = max(len(row) for row in before) + 1.5
    for rank in range(world_size):
        y = world_size - 1 - rank
        ax.text(-0.3, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=8)
        _draw_row(ax, before[rank], 0, y, world_size, length, faded=False)
        _draw_row(ax, after[rank], right, y, 0 if combined else world_size, length, faded=rank in unspecified)
    width = right + max(len(row) for row in after)
    ax.annotate("", xy=(right - 0.2, world_size / 2), xytext=(right - 1.3, world_size / 2),
                arrowprops={"arrowstyle": "->"})
    ax.set(xlim=(-2.2, width + 0.2), ylim=(-0.2, world_size + 0.2), title=operation)
    ax.axis("off")
    return ax


def draw_collectives(run: Run, operations: Sequence[str], unspecified: dict[str, Sequence[int]] | None = None,
                     columns: int = 2, combined: Sequence[str] = ()) -> np.ndarray:
    """One picture per operation, side by side in a grid of `columns` columns (`combined`: see draw_collective)."""
    rows = (len(operations) + columns - 1) // columns
    world_size = len(run.results)
    _, axes = plt.subplots(rows, columns, figsize=(10, rows * (0.6 + 0.45 * world_size)), dpi=80,
                           layout="constrained", squeeze=False)
    for ax, operation in zip(axes.flat, operations, strict=False):
        draw_collective(run, operation, ax=ax, unspecified=(unspecified or {}).get(operation, ()),
                        combined=operation in combined)
    for ax in axes.flat[len(operations):]:
        ax.axis("off")
    return axes


def draw_barrier(run: Run, ax: plt.Axes | None = None) -> plt.Axes:
    """Each rank's wait at the barrier: from when it arrived to when it was let through."""
    ranks = sorted(run.results)
    times = [run.results[rank]["barrier"] for rank in ranks]
    start = min(t["arrived"] for t in times)
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 0.6 + 0.4 * len(ranks)), dpi=80, layout="constrained")
    for rank, t in zip(ranks, times, strict=True):
        arrived, left = (t["arrived"] - start) * 1e3, (t["left"] - start) * 1e3
        ax.barh(rank, max(left - arrived, 1.0), left=arrived, color=RANK_COLOURS[rank % 10], alpha=0.7)
        ax.plot([arrived], [rank], "k|", markersize=12)
    ax.axvline(max(t["arrived"] - start for t in times) * 1e3, color="black", linestyle="--",
               linewidth=1, label="last rank arrives")
    ax.set(yticks=ranks, yticklabels=[f"rank {r}" for r in ranks], xlabel="milliseconds",
           title="barrier: waiting (bar) until the last rank arrives")
    ax.invert_yaxis()
    ax.legend(loc="lower right", fontsize=8)
    return ax


def ring_holdings(run: Run) -> list[list[list[list[int]]]]:
    """From collectives_ring.py's trace: for each step, each rank, each chunk, the ranks whose numbers the chunk
    holds (rank r contributed 2**r, so a sum is a set of ranks written in binary)."""
    ranks = sorted(run.results)
    traces = [run.results[rank]["trace"] for rank in ranks]
    return [[[[bit for bit in range(len(ranks)) if int(chunk[0]) >> bit & 1] for chunk in traces[rank][step]]
             for rank in range(len(ranks))] for step in range(len(traces[0]))]


def draw_ring_steps(run: Run) -> np.ndarray:
    """The hand-written ring on N ranks, step by step: rows are ranks, columns the N chunks, and each cell names the
    ranks whose numbers the chunk holds (green: all of them, the finished sum)."""
    holdings = ring_holdings(run)
    steps, world_size = len(holdings), len(holdings[0])
    _, axes = plt.subplots(1, steps, figsize=(1.6 * steps + 0.6, 0.6 + 0.5 * world_size), dpi=80,
                           layout="constrained", squeeze=False)
    for step, ax in enumerate(axes[0]):
        for rank in range(world_size):
            y = world_size - 1 - rank
            for column, members in enumerate(holdings[step][rank]):
                done = len(members) == world_size
                colour = "tab:green" if done else RANK_COLOURS[members[0] % 10] if len(members) == 1 else \
                    COMBINED_COLOUR
                ax.add_patch(Rectangle((column, y), 0.95, 0.8, facecolor=colour, alpha=0.75, edgecolor="black",
                                       linewidth=0.5))
                ax.text(column + 0.47, y + 0.4, "+".join(map(str, members)), ha="center", va="center", fontsize=7)
            if step == 0:
                ax.text(-0.2, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=8)
        phase = "start" if step == 0 else (f"reduce-scatter {step}" if step < world_size
                                           else f"all-gather {step - world_size + 1}")
        ax.set(xlim=(-0.1, world_size), ylim=(-0.1, world_size), title=phase)
        ax.title.set_fontsize(9)
        ax.axis("off")
    return axes


def bus_factor(world_size: int) -> float:
    """2(N-1)/N: the fraction of the tensor each rank sends (and receives) in a ring all-reduce."""
    return 2 * (world_size - 1) / world_size


def predict_allreduce_seconds(size_bytes: float, world_size: int, latency: float, bandwidth: float,
                              algorithm: str = "ring") -> float:
    """Time of one all_reduce of `size_bytes` on `world_size` ranks, from a 2-rank fit t = latency + S / bandwidth.

    Ring (gloo's default, gloo/allreduce.cc): 2(N-1) neighbour steps, each one chunk of S/N bytes. Each step
    pays a fixed cost alpha, and every rank sends 2(N-1)/N * S bytes at `bandwidth`:
        t(S, N) = 2(N-1) alpha + 2(N-1)/N * S / bandwidth.
    On 2 ranks that is 2 alpha + S / bandwidth, so the fitted 2-rank `latency` is 2 alpha, not alpha:
        t(S, N) = (N-1) latency + 2(N-1)/N * S / bandwidth,  and t(S, 2) is the fit itself.
    The model assumes that every rank has a link and a CPU of its own, as on a cluster.
    """
    if algorithm != "ring":
        raise ValueError(f"unknown algorithm {algorithm!r}: only 'ring' is modelled")
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    return (world_size - 1) * latency + bus_factor(world_size) * size_bytes / bandwidth


def bandwidth_rows(sizes: Sequence[int], seconds: Sequence[float], world_size: int) -> list[dict[str, float]]:
    """Per size: time, algorithm bandwidth (bytes / time) and bus bandwidth (algbw x 2(N-1)/N), in GB/s."""
    return [{"bytes": size, "ms": t * 1e3, "algbw GB/s": size / t / 1e9,
             "busbw GB/s": size / t / 1e9 * bus_factor(world_size)}
            for size, t in zip(sizes, seconds, strict=True)]


def fit_latency_bandwidth(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Fit time = latency + size / bandwidth; return (latency in s, bandwidth in bytes/s).

    Least squares on *relative* error, so that the 1 KB points count as much as the 64 MB ones.
    """
    sizes_array, seconds_array = np.asarray(sizes, float), np.asarray(seconds, float)
    design = np.stack([np.ones_like(sizes_array), sizes_array], axis=1) / seconds_array[:, None]
    (latency, inverse_bandwidth), *_ = np.linalg.lstsq(design, np.ones_like(seconds_array), rcond=None)
    return float(latency), float(1 / inverse_bandwidth)


def format_bytes(size: float) -> str:
    """1024 -> '1 KB', 67108864 -> '64 MB' (binary units, as message sizes usually are)."""
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.3g} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


# Collectives that move data, and the object-pickling send/recv (the exercise wants tensor send/recv/isend/irecv).
# No torch.Tensor method has one of these names, so `anything.all_gather(` is refused whatever the module is called
# (`dist.`, `D.`, `c10d.`)
_ALWAYS = (r"all_gather(?:_into_tensor|_single|_object)?|all_reduce|broadcast(?:_object_list)?|"
           r"reduce_scatter(?:_tensor|_single)?|all_to_all(?:_single)?|gather_object|scatter_object_list|"
           r"send_object_list|recv_object_list")
# these three are also tensor methods (t.gather, t.scatter) or other functions (functools.reduce): refused only as
# attributes of torch.distributed under one of its usual names or an alias the script gives it
_AMBIGUOUS = r"gather|scatter|reduce"
_COLLECTIVE_CALL = re.compile(rf"(?<=[\w)\]])\s*\.\s*({_ALWAYS})\s*\(")
# `from torch.distributed import all_gather as ag` hides the call's name: the import itself is refused
_COLLECTIVE_IMPORT = re.compile(
    r"from\s+torch\.distributed(?:\.distributed_c10d)?\s+import\s+[^\n]*?"
    rf"(?:\b({_ALWAYS}|{_AMBIGUOUS})\b|(\*))")
_DIST_ALIAS = re.compile(r"import\s+torch\.distributed(?:\.distributed_c10d)?\s+as\s+(\w+)|"
                         r"from\s+torch(?:\.distributed)?\s+import\s+(?:distributed|distributed_c10d)\s+as\s+(\w+)")


def _collective_used(source: str) -> str | None:
    """The name of a collective that `source` calls (or imports from torch.distributed), else None."""
    found = _COLLECTIVE_CALL.search(source)
    if found:
        return found.group(1)
    found = _COLLECTIVE_IMPORT.search(source)
    if found:
        return found.group(1) or "* (a star import of torch.distributed)"
    aliases = {"dist", "distributed", "c10d", "distributed_c10d"}
    aliases |= {name for pair in _DIST_ALIAS.findall(source) for name in pair if name}
    names = "|".join(sorted(aliases))
    found = re.search(rf"(?<![\w.])(?:torch\s*\.\s*)?(?:{names})\s*\.\s*({_AMBIGUOUS})\s*\(", source)
    return found.group(1) if found else None


_REQUEST_CALLS = {"isend", "irecv", "batch_isend_irecv"}
_WAIT_CALLS = {"wait", "wait_all"}


def _called_name(node: ast.AST) -> str | None:
    """The name a call calls (`dist.isend(...)` -> "isend"), or None when `node` is not a call."""
    if not isinstance(node, ast.Call):
        return None
    return node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)


def _unwaited_requests(source: str) -> str | None:
    """What a script does wrong with the requests isend/irecv return, said with its line; None when nothing is.
    A request thrown away (`dist.isend(...)` as a statement, or a list of them built and dropped), or requests
    never waited for (no wait() anywhere in the script)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # the launch reports it, with its line
    for statement in ast.walk(tree):
        if not isinstance(statement, ast.Expr):
            continue
        value = statement.value
        if isinstance(value, (ast.ListComp, ast.GeneratorExp)):
            value = value.elt
        calls = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
        thrown = next((name for name in map(_called_name, calls) if name in _REQUEST_CALLS), None)
        if thrown:
            return (f"line {statement.lineno} throws away the request that dist.{thrown}(...) returns, so nothing "
                    "ever wait()s for it. Keep every request isend and irecv return (in a list) and call wait() on "
                    "each before you read the gathered tensors")
    names = {_called_name(node) for node in ast.walk(tree)}
    if names & _REQUEST_CALLS and not names & _WAIT_CALLS:
        return ("your requests from isend/irecv are never waited for (there is no wait() in the script). Call "
                "wait() on every one before you read the gathered tensors")
    return None


def _reading_of_a_hang(where: dict[int, str]) -> str:
    """What the places the ranks waited in say about the mistake (read from `where`, not guessed)."""
    sending = sorted(rank for rank, line in where.items() if line.startswith("waiting in dist.send"))
    receiving = sorted(rank for rank, line in where.items()
                       if line.startswith("waiting in dist.recv") or re.match(r"in [\w.]*\.wait at ", line))
    if sending and not receiving:
        return (f"Rank{'s' if len(sending) > 1 else ''} {', '.join(map(str, sending))} sat in a blocking dist.send: "
                "gloo's send returns only once its partner has posted the matching recv, and the partner was itself "
                "in send. That is the deadlock of the lesson's send/recv section: use isend/irecv and wait() on them "
                "all, or let one rank of each pair receive first")
    if receiving:
        return (f"Rank{'s' if len(receiving) > 1 else ''} {', '.join(map(str, receiving))} waited for a message that "
                "never completed, in recv or in a request's wait(): a receive whose message was never sent (or "
                "was sent to another rank: check each src= and dst=), or a send that no rank receives")
    return "No rank was in send or recv: the lines above say what each one waited for"


def _collectives_recorded(run: Run) -> str | None:
    """A data-moving collective torch's flight recorder logged on any rank (the harness hands them back), else None."""
    for rank in sorted(run.results):
        for name in run.results[rank].get("collectives", []):
            operation = name.split(":", 1)[-1].split(" ")[0]
            if re.search(r"gather|scatter|reduce|broadcast|all_?to_?all", operation):
                return operation
    return None


def check_all_gather(script: str | Path, nproc: int = 3, timeout: float = 60) -> bool:
    """The exercise: does `script` build all_gather from point-to-point ops? Prints why or why not.

    The script must give rank r the tensor [10r, 10r+1, 10r+2], build the gathered list without
    dist.all_gather or any other collective, and hand it back with result(gathered=[...]). It runs under
    helpers/workers/collectives_all_gather_check.py, which also hands back the collectives torch recorded.
    """
    source = Path(script).read_text()
    called = _collective_used(source)
    if called:  # a broadcast per rank, or an all_reduce of padded tensors, also gives the right answer
        return not_yet(f"build it from send/recv (or isend/irecv), without calling dist.{called} "
                       "or any other collective (the exercise allows send, recv, isend and irecv only).")
    unwaited = _unwaited_requests(source)
    if unwaited:  # timing decides what such a script does (garbage, a hang, or by luck the right answer)
        return not_yet(f"{unwaited}: until wait() returns, a receive may not have arrived yet, and with gloo a "
                       "request that is thrown away can be cancelled before its message moves.")
    announce_run(Path(script).name, nproc, timeout, stop_after=10)
    try:
        run = launch(CHECK_HARNESS, nproc=nproc, args=[str(Path(script).resolve())], echo=False, timeout=timeout)
    except LaunchTimeout as error:
        return not_yet(f"the script was still running after {timeout:g} s. Where each rank was:"
                       f"{each_rank(error.where)}\n{_reading_of_a_hang(error.where)}. Next time, press Stop (■) "
                       "as soon as it seems stuck: the launcher says where each rank waits at once.")
    except WorkerFailed as error:
        return not_yet_crashed(error, f"{Path(script).name}")
    recorded = _collectives_recorded(run)
    if recorded:
        return not_yet(f"torch recorded a dist.{recorded} call while your script ran: build it from send/recv (or "
                       "isend/irecv) only, without any collective.")
    expected = [[10.0 * rank + i for i in range(3)] for rank in range(nproc)]
    for rank in range(nproc):
        got: Any = run.results.get(rank, {}).get("gathered")
        if isinstance(got, list) and len(got) == nproc and got[rank] != expected[rank] and all(
                got[other] == expected[other] for other in range(nproc) if other != rank):
            return not_yet(f"rank {rank}'s entry {rank} (its own tensor) was never filled: it holds {got[rank]}, "
                           f"expected {expected[rank]}.")
        strangers = [k for k, entry in enumerate(got) if entry not in expected] if isinstance(got, list) else []
        if got != expected and strangers:  # an entry nothing was received into, or read before its wait()
            k = strangers[0]
            misplaced = [(j, expected.index(entry)) for j, entry in enumerate(got)
                         if entry in expected and expected.index(entry) != j]
            if misplaced:  # e.g. receiving into gathered[(peer + 1) % world_size]: one entry left as allocated
                j, sender = misplaced[0]
                return not_yet(f"on rank {rank}, entry {k} holds {got[k]}, values no rank sent (nothing was received "
                               f"into it), and entry {j} holds rank {sender}'s tensor: receive rank j's tensor into "
                               f"entry j, recv(gathered[j], src=j); check the index each irecv writes.")
            return not_yet(f"on rank {rank}, entry {k} holds {got[k]}, which is no rank's tensor (expected "
                           f"{expected[k]}): an irecv read before its wait(), an entry no irecv writes into, or a "
                           "send of a buffer not filled yet (send your own tensor to every peer).")
        if isinstance(got, list) and sorted(got) == expected and got != expected:
            k = next(k for k in range(nproc) if got[k] != expected[k])
            return not_yet(f"rank {rank} holds every rank's tensor, but out of order: its entry {k} is rank "
                           f"{expected.index(got[k])}'s tensor {got[k]}. Entry j must be rank j's tensor: receive "
                           f"it with recv(..., src=j) into entry j (a recv without src takes whichever message "
                           f"comes first).")
        if got != expected:
            return not_yet(f"rank {rank} gathered {got}, expected {expected}.")
    return correct(f"each of {nproc} ranks holds every rank's tensor, in rank order, "
                   "built from point-to-point messages only.")
