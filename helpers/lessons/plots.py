"""Pictures the lessons need, from a Run's metrics or plain numbers. Every function returns its Axes.

    from helpers.lessons.plots import plot_metric, plot_bars, plot_lines
    ax = plot_metric(run, "loss", ylabel="cross-entropy loss")  # assign it: under nbval ";" does not hide it
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.ticker import NullFormatter, NullLocator

FIGSIZE = (6.4, 3.6)


def _axes(ax: plt.Axes | None) -> plt.Axes:
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, dpi=80, layout="constrained")
    return ax


def plot_metric(run_or_rows: Any, name: str, *, x: str = "step", ax: plt.Axes | None = None,
                title: str | None = None, ylabel: str | None = None, xlabel: str | None = None,
                label: str = "rank {rank}", logy: bool = False) -> plt.Axes:
    """One line per rank: metric `name` against `x` (rows come from run.metrics)."""
    rows = getattr(run_or_rows, "metrics", run_or_rows)
    series: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for row in rows:
        if name in row and row.get(x) is not None:
            series[row["rank"]].append((row[x], row[name]))
    if not series:
        raise ValueError(f"no metric rows with both {name!r} and {x!r}; reported names: "
                         f"{sorted({k for row in rows for k in row})}")
    ax = _axes(ax)
    for rank, points in sorted(series.items()):
        points.sort()
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label.format(rank=rank))
    ax.set(title=title or f"{name} per rank", xlabel=xlabel or x, ylabel=ylabel or name)
    if logy:
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    return ax


def plot_bars(values: Mapping[str, float], *, ylabel: str, title: str, errors: Mapping[str, float] | None = None,
              ax: plt.Axes | None = None, fmt: str = "{:.3g}") -> plt.Axes:
    """A comparison bar chart, each bar labelled with its value."""
    ax = _axes(ax)
    names = list(values)
    heights = [values[n] for n in names]
    yerr = [errors[n] for n in names] if errors else None
    bars = ax.bar(names, heights, yerr=yerr, capsize=4, color=plt.rcParams["axes.prop_cycle"].by_key()["color"])
    ax.bar_label(bars, labels=[fmt.format(h) for h in heights], padding=2)
    ax.set(title=title, ylabel=ylabel)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    return ax


def plot_lines(series: Mapping[str, tuple[Sequence[float], Sequence[float]]], *, xlabel: str, ylabel: str,
               title: str, logx: bool = False, logy: bool = False, ax: plt.Axes | None = None) -> plt.Axes:
    """Several named (xs, ys) curves on one set of axes, e.g. bandwidth against message size."""
    ax = _axes(ax)
    for name, (xs, ys) in series.items():
        ax.plot(xs, ys, marker=".", label=name)
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3, which="both")
    return ax


def plot_process_model(workers: Sequence[Mapping[str, Any]], title: str = "One job, as torchrun starts it") -> plt.Axes:
    """Nodes as boxes, one worker process per slot, each labelled with its ranks (from a real run).

    `workers`: one mapping per process with node, LOCAL_RANK, RANK and WORLD_SIZE (whoami.py's results).
    """
    nodes = sorted({int(w["node"]) for w in workers})
    per_node = max(sum(int(w["node"]) == n for w in workers) for n in nodes)
    _, ax = plt.subplots(figsize=(2.9 * len(nodes) + 0.6, 2.2 + 0.9 * per_node), dpi=80)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for column, node in enumerate(nodes):
        x = 0.3 + column * 2.9
        ax.add_patch(plt.Rectangle((x, 0.6), 2.6, 0.9 * per_node + 0.6, fill=False, lw=1.5))
        ax.text(x + 1.3, 0.9 * per_node + 1.35, f"node {node} (one torchrun agent)", ha="center", fontsize=9)
        mine = sorted((w for w in workers if int(w["node"]) == node), key=lambda w: int(w["LOCAL_RANK"]))
        for row, w in enumerate(mine):
            y = 0.9 * per_node + 0.2 - 0.9 * row
            ax.add_patch(plt.Rectangle((x + 0.2, y - 0.3), 2.2, 0.7, color=colours[int(w["RANK"]) % 10], alpha=0.25))
            ax.text(x + 1.3, y + 0.05, f"process: RANK {w['RANK']}\nLOCAL_RANK {w['LOCAL_RANK']}",
                    ha="center", va="center", fontsize=9)
    world = workers[0]["WORLD_SIZE"]
    ax.text(0.3, 0.2, f"WORLD_SIZE = {world}: the agents meet at the rendezvous; the workers\n"
            f"then meet at the store at MASTER_ADDR:MASTER_PORT and talk directly", fontsize=9)
    ax.set(xlim=(0, 0.3 + 2.9 * len(nodes)), ylim=(0, 0.9 * per_node + 1.7), title=title)
    ax.axis("off")
    return ax


def plot_timeline(events: Sequence[dict[str, Any]], *, title: str, ax: Any = None) -> Any:
    """One row per rank: forward (blue) and backward (orange) intervals in milliseconds from the start."""
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
              labels=list(colours), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")  # beside the bars
    ax.grid(axis="x", alpha=0.3)
    return ax


def plain_log_ticks(ax: Any, ticks: Sequence[float], axis: str = "x") -> None:
    """Label a log axis with the given values as plain numbers (1, 2, 4, 8), not as 2x10^0."""
    which = ax.xaxis if axis == "x" else ax.yaxis
    which.set_ticks(list(ticks), [f"{t:g}" for t in ticks])
    which.set_minor_locator(NullLocator())
    which.set_minor_formatter(NullFormatter())


def plot_timings(timings: Mapping[str, Any], *, title: str, unit: float = 1e-3, ylabel: str = "ms per step",
                 ax: plt.Axes | None = None) -> plt.Axes:
    """Timings from helpers.kit.timing (name -> Timing): for each setting its median wall time (a bar, with the
    lowest and highest round as a whisker) and its median CPU time (a narrower hatched bar beside it)."""
    ax = _axes(ax)
    names = list(timings)
    positions = range(len(names))
    for offset, kind, width, style in ((-0.18, "wall", 0.36, {}), (0.16, "cpu", 0.26, {"hatch": "//", "alpha": 0.5})):
        medians = [timings[n].median(kind) / unit for n in names]
        spreads = [timings[n].spread(kind) for n in names]
        whiskers = [[m - low / unit for m, (low, _) in zip(medians, spreads, strict=True)],
                    [high / unit - m for m, (_, high) in zip(medians, spreads, strict=True)]]
        ax.bar([p + offset for p in positions], medians, width=width, yerr=whiskers, capsize=3,
               color="tab:blue" if kind == "wall" else "tab:gray", label=f"{kind} time" if kind == "wall" else
               "CPU time (all ranks)", **style)
    ax.set_xticks(list(positions), names)
    ax.set(title=title, ylabel=ylabel)
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    return ax
