"""Library code for lesson 07 (when the model does not fit): memory accounting, pipeline schedules, timelines.

    from helpers.model_parallel import memory_per_rank, pipeline_schedule
    memory_per_rank(n_params=1_000_000, world_size=2, mode="fsdp")    # bytes per rank by part
    pipeline_schedule(stages=2, microbatches=4, schedule="1f1b")        # slots, bubble, peak in flight

Workers import `held_bytes`, `SavedActivations`, `SimulatedWork` and `Stopwatch` from here; the notebook
imports the formulas, `measured_slots` and `plot_timeline`. The model, `mlp`, lives in helpers/models.py.
Taught in notebooks/07_model_parallel.ipynb.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from itertools import pairwise
from statistics import median
from typing import Any

import torch
from torch import nn

# What one rank keeps per parameter, in bytes, for each precision (the optimizer's own state comes on top).
# fp32 and autocast are the same here: autocast (torch.amp) keeps fp32 weights and gradients; its 16-bit
# casts are transient (cached while the autocast context is open, then dropped). "mixed" is the ZeRO paper's count
# (fp16 weights and gradients, and an fp32 master copy of the weights that the optimizer updates).
PRECISIONS = {"fp32": {"weights": 4, "gradients": 4, "master": 0},
              "autocast": {"weights": 4, "gradients": 4, "master": 0},
              "mixed": {"weights": 2, "gradients": 2, "master": 4}}
# fp32 state per parameter: Adam's exp_avg and exp_avg_sq, SGD's momentum buffer, plain SGD nothing.
OPTIMIZER_STATE = {"adam": 8, "sgd-momentum": 4, "sgd": 0}
# Which parts each mode shards across ranks (ZeRO stages 0 to 3); the rest is replicated on every rank.
MODES = {"ddp": "DDP (nothing sharded)", "zero1": "ZeRO-1 (optimizer state sharded)",
         "zero2": "ZeRO-2 (+ gradients sharded)", "fsdp": "ZeRO-3 / FSDP (+ weights sharded)"}
_SHARDED = {"ddp": set(), "zero1": {"optimizer state"}, "zero2": {"optimizer state", "gradients"},
            "fsdp": {"optimizer state", "gradients", "weights"}}


def memory_per_rank(n_params: int, world_size: int, mode: str, precision: str = "fp32",
                    optimizer: str = "adam", activation_bytes: float = 0) -> dict[str, float]:
    """Bytes one rank holds, by part: weights, gradients, optimizer state (with any fp32 master copy), activations.

    Activations are per rank and no mode shards them (they grow with the per-rank batch).
    """
    for name, value, allowed in (("mode", mode, MODES), ("precision", precision, PRECISIONS),
                                 ("optimizer", optimizer, OPTIMIZER_STATE)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {sorted(allowed)}, not {value!r}")
    per_param = PRECISIONS[precision]
    full = {"weights": per_param["weights"], "gradients": per_param["gradients"],
            "optimizer state": per_param["master"] + OPTIMIZER_STATE[optimizer]}
    parts = {part: n_params * size / (world_size if part in _SHARDED[mode] else 1) for part, size in full.items()}
    return {**parts, "activations": float(activation_bytes)}


def split_stages(model: nn.Sequential, parts: int) -> list[nn.Sequential]:
    """Cut a Sequential into `parts` consecutive stages holding about equal numbers of parameters."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    total, bounds, running = sum(sizes), [0], 0
    for index, size in enumerate(sizes):
        running += size
        if len(bounds) < parts and running >= total * len(bounds) / parts:
            bounds.append(index + 1)
    bounds.append(len(model))
    return [model[start:end] for start, end in pairwise(bounds)]


def activation_bytes(per_rank_batch: int, width: int, hidden_layers: int, bytes_per_value: int = 4) -> int:
    """What autograd keeps for backward in `mlp`: the input and every ReLU output (Linear reuses them)."""
    return per_rank_batch * (28 * 28 + (hidden_layers + 1) * width) * bytes_per_value


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe or 1F1B step with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def _stage_order(stage: int, stages: int, microbatches: int, schedule: str) -> list[str]:
    """The order in which one stage runs its forwards (F0, F1, ...) and backwards (B0, B1, ...)."""
    forwards = [f"F{i}" for i in range(microbatches)]
    backwards = [f"B{i}" for i in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    if schedule != "1f1b":
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', not {schedule!r}")
    # As Schedule1F1B in torch/distributed/pipelining/schedules.py: stage s first runs min(m, p - s)
    # forwards, then alternates one backward and one forward, then drains the remaining backwards.
    warmup = min(microbatches, stages - stage)
    order = forwards[:warmup]
    for index, backward in enumerate(backwards):
        order.append(backward)
        if warmup + index < microbatches:
            order.append(forwards[warmup + index])
    return order


def pipeline_schedule(stages: int, microbatches: int, schedule: str = "gpipe") -> dict[str, Any]:
    """Replay a schedule in unit time slots: every forward and every backward of a micro-batch takes one slot.

    A stage runs its actions in the schedule's order, each as soon as its input is there: forward i needs
    the previous stage's forward i, backward i the next stage's backward i. Returns `slots` (one row per
    stage: "F3", "B0" or None for idle), `bubble` (idle share of all stage-slots) and `peak_in_flight`
    (per stage, the most micro-batches whose activations are held at once: forwards run, backwards not yet).
    """
    orders = [_stage_order(s, stages, microbatches, schedule) for s in range(stages)]
    finished: dict[tuple[int, str], int] = {}
    free_at, position = [0] * stages, [0] * stages
    while any(position[s] < len(orders[s]) for s in range(stages)):
        for s in range(stages):
            while position[s] < len(orders[s]):
                action = orders[s][position[s]]
                neighbour = s - 1 if action[0] == "F" else s + 1
                if 0 <= neighbour < stages and (neighbour, action) not in finished:
                    break  # waits for the neighbour stage
                ready = finished.get((neighbour, action), 0)
                start = max(free_at[s], ready)
                finished[(s, action)] = free_at[s] = start + 1
                position[s] += 1
    length = max(free_at)
    slots: list[list[str | None]] = [[None] * length for _ in range(stages)]
    for (s, action), end in finished.items():
        slots[s][end - 1] = action
    return {"slots": slots, "bubble": sum(row.count(None) for row in slots) / (stages * length),
            "peak_in_flight": [_peak_in_flight(order) for order in orders]}


def _peak_in_flight(order: Sequence[str]) -> int:
    held, peak = 0, 0
    for action in order:
        held += 1 if action[0] == "F" else -1
        peak = max(peak, held)
    return peak


def measured_slots(events: Sequence[dict[str, Any]]) -> list[list[str | None]]:
    """Turn measured intervals {rank, kind, start, end} into rows of slots, as `pipeline_schedule` gives them.

    The slot is the median measured action; each gap between actions counts as round(gap / slot) idle
    slots, so small delays (a send, Python) do not add up into extra slots. Micro-batches are numbered in
    the order each rank ran them (both schedules run forwards and backwards in micro-batch order).
    """
    slot = median(e["end"] - e["start"] for e in events)
    begin = min(e["start"] for e in events)
    ranks = sorted({e["rank"] for e in events})
    rows = []
    for rank in ranks:
        row: list[str | None] = []
        counts = {"forward": 0, "backward": 0}
        previous_end = begin
        for event in sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start"]):
            row += [None] * round((event["start"] - previous_end) / slot)
            row.append(f"{event['kind'][0].upper()}{counts[event['kind']]}")
            counts[event["kind"]] += 1
            previous_end = event["end"]
        rows.append(row)
    length = max(len(row) for row in rows)
    return [row + [None] * (length - len(row)) for row in rows]


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (only the local shard of a sharded DTensor)."""
    return sum(_local(tensor).numel() * tensor.element_size() for tensor in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class _Saved:
    """What autograd stores instead of a saved tensor while SavedActivations is on: it knows when it is freed."""

    def __init__(self, tensor: torch.Tensor, key: tuple, counter: SavedActivations) -> None:
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self) -> None:
        self.counter._release(self.key)


class SavedActivations:
    """Counts the bytes autograd saves for backward while `model` runs (its weights left out).

    `bytes`: everything saved while the context was on. `live`/`peak`: what is saved and not yet freed,
    now and at most (autograd drops saved tensors once the backward that needs them has run). Counted with
    `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd saves outside a
    `torch.utils.checkpoint` region (inside one, the checkpoint's own hooks take over).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.bytes = self.live = self.peak = 0
        self._held: dict[tuple, list[int]] = {}  # key -> [times saved and not freed, bytes]

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Looked up now: FSDP swaps in gathered (unsharded) weights only while a layer runs.
        weights = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        if tensor.untyped_storage().data_ptr() in weights:
            return tensor
        # A tensor saved twice (a ReLU output is also the next Linear's input) is held once.
        key = (tensor.data_ptr(), tensor.numel(), tensor.element_size())
        if key not in self._held:
            size = tensor.numel() * tensor.element_size()
            self._held[key] = [0, size]
            self.bytes += size
            self.live += size
            self.peak = max(self.peak, self.live)
        self._held[key][0] += 1
        return _Saved(tensor, key, self)

    def _release(self, key: tuple) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._held[key]

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Sleep(torch.autograd.Function):
    """Identity that takes `seconds` in forward and again in backward, like a stage with fixed compute."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SimulatedWork(nn.Module):
    """Adds `ms_per_sample` x batch milliseconds to a stage's forward and to its backward (none if 0).

    On a 2-core CPU a stage of a small MLP computes a micro-batch in about the time a `gloo` message takes,
    so the pipeline's idle time would be mostly messaging. Sleeping makes the stage time known and lets two
    processes share two busy cores without slowing each other.
    """

    def __init__(self, ms_per_sample: float) -> None:
        super().__init__()
        self.ms_per_sample = ms_per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms_per_sample == 0:
            return x
        return _Sleep.apply(x, self.ms_per_sample * x.shape[0] / 1e3)


class _Mark(torch.autograd.Function):
    """Identity that records the time when the forward and the backward pass through it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, watch: Stopwatch, name: str) -> torch.Tensor:
        ctx.watch, ctx.name = watch, name
        watch.times.append((f"forward {name}", time.time()))
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.watch.times.append((f"backward {ctx.name}", time.time()))
        return grad, None, None


class Stopwatch(nn.Module):
    """Wraps a stage so that every forward and backward through it becomes a (kind, start, end) interval."""

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.times: list[tuple[str, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The first stage gets plain data; asking for its gradient is what makes "backward start" fire.
        x = _Mark.apply(x if x.requires_grad else x.detach().requires_grad_(), self, "start")
        return _Mark.apply(self.stage(x), self, "end")

    def intervals(self) -> list[tuple[str, float, float]]:
        """Forward runs from 'start' to 'end'; backward runs back from 'end' to 'start'."""
        intervals, opened = [], {}
        for label, moment in self.times:
            kind, mark = label.split()
            if (kind, mark) in (("forward", "start"), ("backward", "end")):
                opened.setdefault(kind, []).append(moment)
            else:
                intervals.append((kind, opened[kind].pop(0), moment))
        return intervals


def idle_fraction(events: Sequence[dict[str, Any]]) -> float:
    """Share of (ranks x step time) in which no rank computes; events are {rank, kind, start, end}."""
    begin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - begin
    ranks = {e["rank"] for e in events}
    busy = sum(e["end"] - e["start"] for e in events)
    return 1 - busy / (span * len(ranks))


def plot_timeline(events: Sequence[dict[str, Any]], *, title: str, ax: Any = None) -> Any:
    """One row per rank: forward (blue) and backward (orange) intervals in milliseconds from the start."""
    import matplotlib.pyplot as plt

    from helpers.plots import FIGSIZE

    if ax is None:
        _, ax = plt.subplots(figsize=(FIGSIZE[0], 1.0 + 0.6 * len({e["rank"] for e in events})), dpi=80,
                             layout="constrained")
    begin = min(e["start"] for e in events)
    colours = {"forward": "tab:blue", "backward": "tab:orange"}
    for event in events:
        ax.broken_barh([((event["start"] - begin) * 1e3, (event["end"] - event["start"]) * 1e3)],
                       (event["rank"] - 0.4, 0.8), color=colours[event["kind"]], edgecolor="white")
    ranks = sorted({e["rank"] for e in events})
    ax.set_yticks(ranks, [f"rank {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set(title=title, xlabel="milliseconds since the step began")
    ax.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()],
              labels=list(colours), loc="upper right", fontsize="small")
    ax.grid(axis="x", alpha=0.3)
    return ax


def plain_log_ticks(ax: Any, ticks: Sequence[float], axis: str = "x") -> None:
    """Label a log axis with the given values as plain numbers (1, 2, 4, 8), not as 2x10^0."""
    from matplotlib.ticker import NullFormatter, NullLocator

    which = ax.xaxis if axis == "x" else ax.yaxis
    which.set_ticks(list(ticks), [f"{t:g}" for t in ticks])
    which.set_minor_locator(NullLocator())
    which.set_minor_formatter(NullFormatter())


def check_smallest_mode(smallest_mode: Any) -> bool:
    """Exercise check: does smallest_mode(n_params, world_size, gpu_bytes) pick the least sharding that fits?"""
    from helpers.checks import correct, not_yet

    cases = [(1_300_000_000, 1, 24e9), (1_500_000_000, 8, 16e9), (7_000_000_000, 8, 40e9),
             (7_000_000_000, 8, 30e9), (7_000_000_000, 8, 24e9), (70_000_000_000, 64, 80e9),
             (70_000_000_000, 8, 80e9)]
    for n_params, world_size, gpu_bytes in cases:
        expected = next((mode for mode in MODES
                         if sum(memory_per_rank(n_params, world_size, mode, precision="mixed").values())
                         <= gpu_bytes), None)
        got = smallest_mode(n_params, world_size, gpu_bytes)
        if got != expected:
            return not_yet(f"{n_params / 1e9:g}B parameters on {world_size} ranks of {gpu_bytes / 1e9:g} GB "
                           f"gave {got!r}, expected {expected!r}.")
    return correct(f"smallest_mode picks the least sharding that fits in all {len(cases)} cases.")
