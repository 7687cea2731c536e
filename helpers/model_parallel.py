"""Library code for lesson 07 (when the model does not fit): memory accounting, timelines, a deep MLP.

    from helpers.model_parallel import zero_bytes_per_rank, bubble_fraction, plot_timeline
    zero_bytes_per_rank(n_params=1_000_000, world_size=2, stage=3)   # bytes each rank holds
    bubble_fraction(stages=2, microbatches=4)                         # (p-1)/(m+p-1) = 0.2

Workers import `mlp`, `held_bytes`, `SavedActivations` and `Stopwatch` from here; the notebook imports
the formulas and `plot_timeline`. Taught in notebooks/07_model_parallel.ipynb.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch import nn

# Bytes per parameter (fp32 training with Adam): the weight, its gradient, Adam's two moments.
FP32_ADAM = {"params": 4, "grads": 4, "optimizer": 8}
# Mixed precision as in the ZeRO paper: fp16 weight and gradient, fp32 master copy + two moments.
MIXED_ADAM = {"params": 2, "grads": 2, "optimizer": 12}
ZERO_STAGES = {0: "DDP (nothing sharded)", 1: "ZeRO-1 (optimizer state sharded)",
               2: "ZeRO-2 (+ gradients sharded)", 3: "ZeRO-3 / FSDP (+ parameters sharded)"}


def mlp(width: int, hidden_layers: int, seed: int = 0) -> nn.Sequential:
    """784 -> width -> (width -> width) x hidden_layers -> 10, ReLUs between: easy to split into parts."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU()]
    for _ in range(hidden_layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


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


def zero_bytes_per_rank(n_params: int, world_size: int, stage: int,
                        bytes_per_param: dict[str, int] = FP32_ADAM) -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on each rank for ZeRO stage 0 (DDP) to 3."""
    if stage not in ZERO_STAGES:
        raise ValueError(f"stage must be one of {sorted(ZERO_STAGES)}, not {stage!r}")
    # Stage s shards the first s of (optimizer, grads, params); the rest is replicated on every rank.
    sharded = {"optimizer": stage >= 1, "grads": stage >= 2, "params": stage >= 3}
    return {part: n_params * bytes_per_param[part] / (world_size if sharded[part] else 1)
            for part in ("params", "grads", "optimizer")}


def activation_bytes(per_rank_batch: int, width: int, hidden_layers: int, bytes_per_value: int = 4) -> int:
    """What autograd keeps for backward in `mlp`: the input and every ReLU output (Linear reuses them)."""
    return per_rank_batch * (28 * 28 + (hidden_layers + 1) * width) * bytes_per_value


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe or 1F1B step with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (only the local shard of a sharded DTensor)."""
    return sum(_local(tensor).numel() * tensor.element_size() for tensor in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


class SavedActivations:
    """Counts the bytes autograd saves for backward while `model` runs forward (its weights left out)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.bytes = 0
        self._seen: set[int] = set()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        # Looked up now: FSDP swaps in gathered (unsharded) weights only while a layer runs.
        weights = {_local(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        # A tensor saved twice (a ReLU output is also the next Linear's input) is held once.
        if storage.data_ptr() not in weights | self._seen:
            self._seen.add(storage.data_ptr())
            self.bytes += storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


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


def check_smallest_stage(smallest_stage: Any) -> bool:
    """Exercise check: does smallest_stage(n_params, world_size, gpu_bytes) pick the right ZeRO stage?"""
    cases = [(1_300_000_000, 1, 24e9), (1_500_000_000, 8, 16e9), (7_000_000_000, 8, 40e9),
             (7_000_000_000, 8, 30e9), (7_000_000_000, 8, 24e9), (70_000_000_000, 64, 80e9),
             (70_000_000_000, 8, 80e9)]
    for n_params, world_size, gpu_bytes in cases:
        expected = next((stage for stage in ZERO_STAGES
                         if sum(zero_bytes_per_rank(n_params, world_size, stage, MIXED_ADAM).values())
                         <= gpu_bytes), None)
        got = smallest_stage(n_params, world_size, gpu_bytes)
        if got != expected:
            print(f"Not yet: {n_params / 1e9:g}B parameters on {world_size} ranks of {gpu_bytes / 1e9:g} GB "
                  f"gave {got!r}, expected {expected!r}.")
            return False
    print(f"Correct: smallest_stage picks the right ZeRO stage in all {len(cases)} cases.")
    return True
