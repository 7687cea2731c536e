"""Library code for lesson 07 (when the model does not fit): memory accounting, pipeline schedules, timelines.

    from helpers.model_parallel import memory_per_rank, pipeline_schedule
    memory_per_rank(n_params=1_000_000, world_size=2, mode="fsdp")    # bytes per rank by part
    pipeline_schedule(stages=2, microbatches=4, schedule="1f1b")        # slots, bubble, peak in flight

The notebook imports the formulas and `measured_slots`; the instruments its workers use (`SavedActivations`,
`SimulatedWork`, `Stopwatch`) are in helpers/instruments.py, `held_bytes` in helpers/tensors.py, the model (`mlp`)
and `split_stages` in helpers/models.py, and `plot_timeline` in helpers/plots.py.
Taught in notebooks/07_model_parallel.ipynb.
"""
from __future__ import annotations

from collections.abc import Sequence
from statistics import median
from typing import Any

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


def idle_fraction(events: Sequence[dict[str, Any]]) -> float:
    """Share of (ranks x step time) in which no rank computes; events are {rank, kind, start, end}."""
    begin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - begin
    ranks = {e["rank"] for e in events}
    busy = sum(e["end"] - e["start"] for e in events)
    return 1 - busy / (span * len(ranks))


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
