"""One timing protocol for every timing claim in the lessons. On a shared 2-core laptop a single timing mostly
measures what else the machine is doing, so a comparison is only made this way:

    from helpers.kit.timing import take_turns, verdict
    timings = take_turns({"DDP": ddp_step, "no all-reduce": quiet_step}, rounds=7, warmup=2)
    print(verdict(timings["DDP"], timings["no all-reduce"]).sentence)

- the settings take turns inside one process (or one launch), in a different order each round, after warm-up;
- every round times each setting once (`repeat` calls), wall time and this process's CPU time side by side;
- each setting reports its median and its spread (the lowest and highest round);
- the verdict is computed: "A is faster than B" only when the two spreads do not overlap (with 5 rounds each, two
  settings that are really the same part that cleanly about once in 126 tries); otherwise "not distinguishable on
  this machine", which is an honest result, and the lesson's text reads whichever verdict the run printed.

Worker side (standard library only): ranks time their own settings and hand the samples back with
`result(timings={name: t.as_dict()})`; `across_ranks` merges them (a step is as slow as its slowest rank).
"""
from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

NOT_DISTINGUISHABLE = "not distinguishable on this machine"


@dataclass
class Timing:
    """One setting's rounds: seconds of wall time and of CPU time per round. `ranks` > 1 once across_ranks merged
    several ranks: wall time is then the slowest rank's, CPU time the sum over the ranks."""

    name: str
    wall: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)
    ranks: int = 1

    def median(self, kind: str = "wall") -> float:
        return statistics.median(getattr(self, kind))

    def spread(self, kind: str = "wall") -> tuple[float, float]:
        values = getattr(self, kind)
        return min(values), max(values)

    def summary(self, kind: str = "wall", unit: float = 1e-3, suffix: str = "ms") -> str:
        """'12.3 ms (11.9-14.0)': the median and, in brackets, the lowest and highest round."""
        low, high = self.spread(kind)
        return f"{_three(self.median(kind) / unit)} {suffix} ({_three(low / unit)}-{_three(high / unit)})"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "wall": list(self.wall), "cpu": list(self.cpu)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Timing:
        return cls(data["name"], list(data["wall"]), list(data.get("cpu", [])))


def _three(value: float) -> str:
    """Three significant figures, without an exponent: 0.0123, 1.23, 12.3, 123, 1230."""
    if value == 0:
        return "0"
    digits = max(0, 2 - int(f"{abs(value):e}".split("e")[1]))
    return f"{value:.{digits}f}"


@dataclass
class Verdict:
    """Which of two settings is faster, if the run can tell; `sentence` says it with the numbers."""

    faster: str | None  # the faster setting's name, or None when the spreads overlap
    slower: str | None
    ratio: float  # median of the slower / median of the faster (>= 1), or of second / first when not distinguishable
    sentence: str

    @property
    def distinguishable(self) -> bool:
        return self.faster is not None


def verdict(first: Timing, second: Timing, kind: str = "wall") -> Verdict:
    """`first` against `second`: faster only when every round of one beat every round of the other."""
    (low1, high1), (low2, high2) = first.spread(kind), second.spread(kind)
    m1, m2 = first.median(kind), second.median(kind)
    ranks = max(first.ranks, second.ranks)
    what = "wall time" if kind == "wall" else ("CPU time" if ranks == 1 else f"CPU time of {ranks} ranks together")
    numbers = f"{first.name} {first.summary(kind)}, {second.name} {second.summary(kind)}"
    if high1 < low2 or high2 < low1:
        fast, slow = (first, second) if high1 < low2 else (second, first)
        ratio = slow.median(kind) / fast.median(kind)
        # CPU time is work done, not how long a step took: "faster" only for wall time
        said = "is faster than" if kind == "wall" else "uses less CPU time than"
        return Verdict(fast.name, slow.name, ratio,
                       f"{fast.name} {said} {slow.name} ({what} {ratio:.2f}x less, median of "
                       f"{len(getattr(fast, kind))} rounds; {numbers}; the spreads do not overlap)")
    ratio = m2 / m1 if m1 else float("nan")
    return Verdict(None, None, ratio, f"{first.name} and {second.name}: {NOT_DISTINGUISHABLE} ({what}: {numbers}; "
                                       f"the spreads overlap)")


def take_turns(settings: dict[str, Callable[[], Any]], rounds: int = 5, warmup: int = 1, repeat: int = 1,
               seed: int = 0, between: Callable[[], Any] | None = None) -> dict[str, Timing]:
    """Time every setting once per round, the settings in a shuffled order each round, after `warmup` untimed
    rounds. A round of one setting is `repeat` calls in a row, divided by `repeat` (seconds per call).
    `between` runs before every turn, warm-up turns included (e.g. a barrier, so that all ranks start a turn
    together)."""
    if rounds < 5:
        raise ValueError(f"rounds must be at least 5 for a verdict to mean anything, got {rounds}")
    order = list(settings)
    shuffler = random.Random(seed)
    timings = {name: Timing(name) for name in order}
    for number in range(warmup + rounds):
        shuffler.shuffle(order)
        for name in order:
            if between is not None:
                between()
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(repeat):
                settings[name]()
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            if number >= warmup:
                timings[name].wall.append(wall / repeat)
                timings[name].cpu.append(cpu / repeat)
    return timings


def across_ranks(per_rank: Iterable[dict[str, dict[str, Any]]]) -> dict[str, Timing]:
    """Merge each rank's timings (as_dict) round by round: a round takes as long as its slowest rank; CPU seconds
    add up over the ranks."""
    merged: dict[str, Timing] = {}
    for timings in per_rank:
        for name, data in timings.items():
            rank = Timing.from_dict(data)
            if name not in merged:
                merged[name] = rank
                continue
            into = merged[name]
            into.wall = [max(a, b) for a, b in zip(into.wall, rank.wall, strict=True)]
            into.cpu = [a + b for a, b in zip(into.cpu, rank.cpu, strict=True)] if rank.cpu else into.cpu
            into.ranks += 1
    return merged


def residual_ratios(measured: Iterable[float], predicted: Iterable[float]) -> list[float]:
    """measured / predicted for each point a model was fitted to or predicts: print them beside any fitted model."""
    return [m / p for m, p in zip(measured, predicted, strict=True)]


def fits_within(ratios: Iterable[float], tolerance: float = 0.25) -> bool:
    """Whether every residual ratio lies within 1 +- tolerance: a model is used to predict only where this holds."""
    return all(abs(ratio - 1) <= tolerance for ratio in ratios)


def outside_every_round(increments: Iterable[float], predicted: float) -> str | None:
    """A predicted increment against the increments measured round by round (setting - control, the two timed in the
    same round): a clause when every round's increment lies on one side of the prediction, else None. The rounds can
    show a prediction missing where the two settings' spreads overlap and `verdict` cannot tell them apart. If the
    prediction were right, and each round's noise as likely to push its increment above it as below, all n rounds
    would fall on one side 1 time in 2**(n - 1)."""
    values = list(increments)
    if len(values) < 5:
        raise ValueError(f"at least 5 paired rounds are needed to judge a prediction, got {len(values)}")
    if all(value > predicted for value in values):
        side = "above"
    elif all(value < predicted for value in values):
        side = "below"
    else:
        return None
    return (f"every one of the {len(values)} rounds' increments lies {side} it (were it right, with each round as "
            f"likely above it as below, that happens 1 time in {2 ** (len(values) - 1)})")
