"""Interactive explorers for the lessons: sliders over the same models the lessons check against runs.

    from helpers.lessons.explorers import allreduce_explorer, bucket_explorer, memory_explorer, pipeline_explorer
    allreduce_explorer(latency, bandwidth, sizes, seconds)   # lesson 01: from this machine's fitted sweep
    bucket_explorer(model, sweep_rows)                        # lesson 03: DDP's own bucketing code
    memory_explorer()                                         # lesson 07: model_parallel.memory_per_rank
    pipeline_explorer()                                       # lesson 07: model_parallel.pipeline_schedule

Each explorer is a thin ipywidgets layer over a plain function that a lesson prints and asserts. Each
`*_figure` function draws the same picture for fixed values without widgets: the lessons show it for the
explorer's starting values, so that a stored notebook reads well where widgets do not run (GitHub, nbviewer, nbval).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt

from helpers.lessons.collectives import format_bytes, predict_allreduce_seconds
from helpers.lessons.model_parallel import MODES, OPTIMIZER_STATE, PRECISIONS, memory_per_rank, pipeline_schedule
from helpers.lessons.plots import FIGSIZE

PARTS = ("weights", "gradients", "optimizer state", "activations")


def tree_allreduce_seconds(size_bytes: float, world_size: int, latency: float, bandwidth: float) -> float:
    """A binomial tree (one partner per level): reduce up, then broadcast down, ceil(log2 N) levels each, the
    whole message at every level (the unpipelined cost in Thakur, Rabenseifner and Gropp, 2005).

    Each level pays one alpha (latency / 2, as in the ring model) plus the whole message at `bandwidth`.
    Not pipelined: NCCL's double binary trees cut the message into chunks so that levels overlap, which keeps
    the logarithmic latency and brings the bandwidth term close to the ring's.
    """
    if world_size < 2:
        return 0.0
    levels = math.ceil(math.log2(world_size))
    return 2 * levels * (latency / 2 + size_bytes / bandwidth)


def allreduce_seconds(size_bytes: float, world_size: int, latency: float, bandwidth: float,
                      algorithm: str = "ring") -> float:
    """The lesson's ring model (helpers.lessons.collectives.predict_allreduce_seconds) or the tree above."""
    if algorithm == "tree":
        return tree_allreduce_seconds(size_bytes, world_size, latency, bandwidth)
    return predict_allreduce_seconds(size_bytes, world_size, latency, bandwidth, algorithm)


def allreduce_figure(latency: float, bandwidth: float, world_size: int = 8, size_bytes: float = 2**24,
                     measured: tuple[Sequence[float], Sequence[float]] | None = None, ax: Any = None) -> Any:
    """Ring and tree models of all_reduce time against message size for `world_size` ranks, with the 2-rank fit
    and the 2-rank measurements it came from."""
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, dpi=80, layout="constrained")
    sizes = [2.0**k for k in range(10, 31)]
    # the fit itself (latency + bytes / bandwidth, what 2 ranks measured)
    ax.plot(sizes, [predict_allreduce_seconds(s, 2, latency, bandwidth) * 1e3 for s in sizes], ":",
            label="2 ranks (the fit)")
    chosen = {}
    for algorithm in ("ring", "tree"):
        line, = ax.plot(sizes, [allreduce_seconds(s, world_size, latency, bandwidth, algorithm) * 1e3 for s in sizes],
                        "-", label=f"{world_size} ranks, {algorithm} model")
        chosen[algorithm] = allreduce_seconds(size_bytes, world_size, latency, bandwidth, algorithm)
        ax.plot([size_bytes], [chosen[algorithm] * 1e3], "*", color=line.get_color(), markersize=12)
    if measured is not None:
        ax.plot(measured[0], [t * 1e3 for t in measured[1]], "o", label="measured here, 2 ranks")
    ax.set(xscale="log", yscale="log", xlabel="message size (bytes)", ylabel="all_reduce time (ms)",
           title=f"{format_bytes(size_bytes)} on {world_size} ranks: ring {chosen['ring'] * 1e3:.3g} ms, "
                 f"tree {chosen['tree'] * 1e3:.3g} ms (models)")
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3, which="both")
    return ax


def ddp_buckets(model: Any, bucket_cap_mb: float | None) -> dict[str, list[int]]:
    """Bytes per gradient bucket when DDP wraps `model`, in step 1 and after DDP's rebuild, from DDP's own code.

    torch 2.14, nn/parallel/distributed.py: `_BucketCapacityConfig.create` turns `bucket_cap_mb` into a first-
    bucket cap (`dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB, when the argument is left at its default; else the
    same as the others) and a cap for the rest (25 MiB by default). `compute_bucket_size_limits` puts every
    parameter in one bucket for step 1 (unless find_unused_parameters=True and static_graph=False); during
    step 1 the reducer records the order in which gradients became ready and then rebuilds the buckets once
    with the two caps, packing with the C++ `compute_bucket_assignment_by_size` (bound as
    `dist._compute_bucket_assignment_by_size`, which this function calls). For a model run front to back,
    gradients become ready back to front, so the rebuild is modelled on the reversed parameter list.
    """
    import torch.distributed as dist
    from torch.nn.parallel.distributed import _BucketCapacityConfig

    config = _BucketCapacityConfig.create(bucket_cap_mb, None, use_python_reducer=False)
    first_limits, _ = config.compute_bucket_size_limits(static_graph=False, find_unused_parameters=False)
    parameters = [p for p in model.parameters() if p.requires_grad]
    ready_order = parameters[::-1]
    caps = [config.first_bucket_bytes_cap, config.bucket_bytes_cap]

    def pack(tensors: list, limits: list[int]) -> list[int]:
        indices, _ = dist._compute_bucket_assignment_by_size(tensors, limits, [False] * len(tensors))
        return [sum(tensors[i].numel() * tensors[i].element_size() for i in bucket) for bucket in indices]

    return {"first_step": pack(parameters, first_limits), "rebuilt": pack(ready_order, caps)}


def bucket_figure(model: Any, bucket_cap_mb: float | None = None, sweep: Sequence[dict] | None = None) -> Any:
    """Left: the buckets DDP makes for `model` at one cap. Right: the lesson's measured sweep, if given."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(FIGSIZE[0] * 1.4, FIGSIZE[1]), dpi=80, layout="constrained")
    sizes = ddp_buckets(model, bucket_cap_mb)["rebuilt"]
    left.bar(range(len(sizes)), [s / 2**20 for s in sizes], color="tab:blue")
    labels = [str(i + 1) if len(sizes) <= 16 or i % 5 == 4 else "" for i in range(len(sizes))]
    left.set_xticks(range(len(sizes)), labels)  # bucket 1, 2, ... (whole numbers, not a continuous axis)
    cap = "default" if bucket_cap_mb is None else f"{bucket_cap_mb:g} MiB"
    left.set(xlabel="bucket, numbered in the order gradients become ready", ylabel="MiB of gradients",
             title=f"bucket_cap_mb = {cap}: {len(sizes)} all-reduces per step after step 1")
    measured = [row for row in sweep or [] if row.get("bucket_cap_mb") is not None]
    if measured:
        caps = [row["bucket_cap_mb"] for row in measured]
        right.plot(caps, [row["calls_per_step"] for row in measured], "o-", color="tab:blue")
        right.set(xscale="log", xlabel="bucket_cap_mb (MiB)", ylabel="all-reduces per step (measured)",
                  title="the lesson's sweep, after the rebuild")
        times = right.twinx()
        times.plot(caps, [row["step_ms"] for row in measured], "s--", color="tab:orange")
        times.set_ylabel("ms per step (measured)", color="tab:orange")
        if bucket_cap_mb is not None:
            right.axvline(bucket_cap_mb, color="k", lw=0.8)
    else:
        right.axis("off")
    return fig


def memory_figure(n_params: float = 7e9, world_size: int = 8, precision: str = "mixed", optimizer: str = "adam",
                  activation_gib: float = 0.0, ax: Any = None) -> Any:
    """Bytes per rank for every mode, stacked by part (helpers.lessons.model_parallel.memory_per_rank)."""
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, dpi=80, layout="constrained")
    bottoms = [0.0] * len(MODES)
    for part, colour in zip(PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:grey"), strict=True):
        values = [memory_per_rank(int(n_params), world_size, mode, precision, optimizer,
                                  activation_gib * 2**30)[part] / 2**30 for mode in MODES]
        ax.bar(list(MODES), values, bottom=bottoms, color=colour, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:,.1f} GiB", ha="center", va="bottom", fontsize="small")
    ax.set(ylabel="GiB per rank", title=f"{n_params / 1e9:g}B parameters, {world_size} ranks, {precision}, {optimizer}")
    ax.legend(fontsize="small")
    return ax


def pipeline_figure(stages: int = 4, microbatches: int = 8, schedule: str = "1f1b", ax: Any = None) -> Any:
    """The slot timeline of a schedule (helpers.lessons.model_parallel.pipeline_schedule), with bubble and peak
    activations."""
    plan = pipeline_schedule(stages, microbatches, schedule)
    if ax is None:
        _, ax = plt.subplots(figsize=(FIGSIZE[0], 1.0 + 0.5 * stages), dpi=80, layout="constrained")
    for stage, row in enumerate(plan["slots"]):
        for slot, action in enumerate(row):
            if action is None:
                continue
            colour = "tab:blue" if action[0] == "F" else "tab:orange"
            ax.broken_barh([(slot, 1)], (stage - 0.4, 0.8), color=colour, edgecolor="white")
            ax.text(slot + 0.5, stage, action, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(stages), [f"stage {s} (peak {p} held)" for s, p in enumerate(plan["peak_in_flight"])])
    ax.invert_yaxis()
    ax.set(xlabel="time slot (one forward or one backward of a micro-batch)",
           title=f"{schedule}, {stages} stages, {microbatches} micro-batches: idle share {plan['bubble']:.0%}")
    return ax


def _explorer(draw, **controls) -> Any:
    """Widgets for `controls` above an output area that `draw(**values)` redraws whenever one changes."""
    import ipywidgets as widgets

    def show(**values) -> None:
        draw(**values)
        plt.show()

    rows = [widgets.HBox(list(controls.values())[i:i + 3]) for i in range(0, len(controls), 3)]
    return widgets.VBox([*rows, widgets.interactive_output(show, controls)])


def allreduce_explorer(latency: float, bandwidth: float, sizes: Sequence[float] | None = None,
                       seconds: Sequence[float] | None = None) -> Any:
    """Message size and world size: the ring and tree models from this machine's fitted latency and bandwidth."""
    import ipywidgets as widgets

    measured = (sizes, seconds) if sizes is not None and seconds is not None else None
    return _explorer(
        lambda size_bytes, world_size: allreduce_figure(latency, bandwidth, world_size, size_bytes, measured),
        size_bytes=widgets.SelectionSlider(options=[(format_bytes(2**k), 2**k) for k in range(10, 31)],
                                           value=2**24, description="message"),
        world_size=widgets.SelectionSlider(options=[2**k for k in range(1, 11)], value=8, description="world size"))


def bucket_explorer(model: Any, sweep: Sequence[dict] | None = None) -> Any:
    """bucket_cap_mb against the buckets DDP makes for `model` (and the lesson's measured sweep)."""
    import ipywidgets as widgets

    return _explorer(
        lambda cap, default: bucket_figure(model, None if default else cap, sweep),
        cap=widgets.FloatLogSlider(value=1.0, base=10, min=-2, max=2, description="cap (MiB)"),
        default=widgets.Checkbox(value=False, description="torch's default instead"))


def memory_explorer() -> Any:
    """Parameters, world size, precision, optimizer and activations: bytes per rank for DDP, ZeRO-1/2, FSDP."""
    import ipywidgets as widgets

    return _explorer(
        lambda billions, world_size, precision, optimizer, activation_gib: memory_figure(
            billions * 1e9, world_size, precision, optimizer, activation_gib),
        # sizes of common models, so that the explorer opens at exactly the 7 B of the lesson's printed table
        billions=widgets.SelectionSlider(options=[0.125, 0.35, 1.3, 3, 7, 13, 34, 70, 175, 405, 1000], value=7,
                                         description="params (B)"),
        world_size=widgets.IntSlider(value=8, min=1, max=512, description="world size"),
        precision=widgets.Dropdown(options=list(PRECISIONS), value="mixed", description="precision"),
        optimizer=widgets.Dropdown(options=list(OPTIMIZER_STATE), value="adam", description="optimizer"),
        activation_gib=widgets.FloatSlider(value=0, min=0, max=64, description="activations GiB"))


def pipeline_explorer() -> Any:
    """Stages, micro-batches and GPipe vs 1F1B: the schedule, its idle share and peak activations per stage."""
    import ipywidgets as widgets

    return _explorer(
        lambda stages, microbatches, schedule: (print("torch's Schedule1F1B needs at least as many micro-batches as "
                                                      "stages: raise the micro-batches")
                                                if schedule == "1f1b" and microbatches < stages
                                                else pipeline_figure(stages, microbatches, schedule)),
        stages=widgets.IntSlider(value=4, min=2, max=8, description="stages"),
        microbatches=widgets.IntSlider(value=8, min=1, max=32, description="micro-batches"),
        schedule=widgets.ToggleButtons(options=["gpipe", "1f1b"], value="1f1b"))
