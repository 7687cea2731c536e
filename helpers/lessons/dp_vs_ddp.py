"""Lesson 03's library (DataParallel vs DDP): reference gradients, DP's traffic, when DDP issues its all-reduces.

    from helpers.lessons.dp_vs_ddp import check_traffic, issue_order, measured_traffic, single_device_gradients
    measured_traffic(model, num_devices=2)     # bytes our CPU DataParallel's Broadcast copied in one iteration
    issue_order(events)                        # how much of the backward was left when DDP issued its first all-reduce

Our rebuild of DataParallel itself is helpers/kit/dp_vs_ddp.py; the counting comm hook is in
helpers/kit/instruments.py.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from helpers.kit.dp_vs_ddp import NaiveDataParallel
from helpers.kit.models import SimpleModel, mlp
from helpers.kit.tensors import own_bytes
from helpers.lessons.checks import correct, not_yet, your_line


def single_device_gradients(module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """The reference: plain forward/backward of the whole batch, gradients returned, module's .grad untouched."""
    params = list(module.parameters())
    return [g.clone() for g in torch.autograd.grad(loss_fn(module(inputs), targets), params)]


def measured_traffic(module: nn.Module, num_devices: int, batch: int = 12) -> dict[str, int]:
    """Bytes our rebuild's Broadcast copied out (weights) and received back (gradients) in one iteration.

    A count of the tensors our CPU Broadcast cloned and summed, not a measurement of torch's GPU traffic."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.rand(batch, 1, 28, 28, generator=generator)
    targets = torch.randint(0, 10, (batch,), generator=generator)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
    report = NaiveDataParallel(module, num_devices, parallel=False, evidence=False).train_step(
        inputs, targets, nn.functional.cross_entropy, optimizer)
    return {"weights_out": report.reduce["bytes_copied"], "grads_back": report.reduce["bytes_from_other_devices"]}


# The formulas a learner writes on the way, each with what it gets wrong (P: parameter bytes, n: devices)
TRAFFIC_MISTAKES: tuple[tuple[Callable[[int, int], float], str], ...] = (
    (lambda p, n: (n - 1) * p, "that is only the weights going out; the gradients come back to device 0 too."),
    (lambda p, n: 2 * n * p, "device 0 keeps the module's own weights: nothing is copied to or from it."),
    (lambda p, n: (2 * n - 1) * p, "the weights go out to n - 1 devices, not n: device 0 keeps the module's own "
                                   "tensors and gets no copy."),
    (lambda p, n: 2 * (n - 1) / n * p, "that is what a ring all-reduce puts through each link (DDP's way, lesson 01). "
                                       "DataParallel does no all-reduce: it copies the weights from device 0 to the "
                                       "others and sums their gradients back onto it."),
    (lambda p, n: 2 * (n - 1) * p / 4, "a quarter of the bytes: parameter_bytes is already in bytes, so do not divide "
                                       "by the 4 bytes of a float32."),
    (lambda p, n: 2 * (n - 1) * p * 4, "four times the bytes: parameter_bytes is already in bytes, so do not multiply "
                                       "by the 4 bytes of a float32."),
)


def _same(answer: float, value: float) -> bool:
    return math.isclose(answer, value, rel_tol=1e-9, abs_tol=1.0)  # a rounded int matches a formula's float


@functools.cache  # counted once per kernel: the bytes depend only on the two models and the device counts
def _traffic_cases() -> tuple[tuple[str, int, int, int], ...]:
    cases = []
    for name, build in (("SimpleModel", SimpleModel), ("mlp(256, 14)", lambda: mlp(256, 14))):
        model = build()
        parameter_bytes = own_bytes(model.parameters())
        for num_devices in (2, 3, 4):
            moved = measured_traffic(model, num_devices)
            cases.append((name, parameter_bytes, num_devices, moved["weights_out"] + moved["grads_back"]))
    return tuple(cases)


def check_traffic(traffic: Callable[[int, int], int]) -> bool:
    """The exercise's check: does traffic(parameter_bytes, num_devices) give the bytes DP moves per iteration?

    Compared with what our rebuild's Broadcast copied and received (measured_traffic), for two models on 2, 3 and 4
    devices; a wrong answer is matched, over every case, against the formulas in TRAFFIC_MISTAKES."""
    cases = _traffic_cases()
    answers = []
    for _, parameter_bytes, num_devices, _ in cases:
        try:
            answer = traffic(parameter_bytes, num_devices)
        except NotImplementedError:
            return not_yet("traffic still raises NotImplementedError. Write its body.")
        except Exception as error:  # a learner's function may raise anything: name it, and the line
            return not_yet(f"traffic({parameter_bytes:,}, {num_devices}) raised {type(error).__name__}: {error}"
                           f"{your_line(traffic, error)}")
        try:
            answers.append(float(answer))
        except (TypeError, ValueError):
            return not_yet(f"traffic({parameter_bytes:,}, {num_devices}) returned {answer!r}, not a number: return "
                           f"the bytes.")
    if all(answer == expected for answer, (*_, expected) in zip(answers, cases, strict=True)):
        return correct("weights out to every device but the first, gradients back from them: "
                       "2 x (devices - 1) x parameter bytes per iteration, as our rebuild's Broadcast counted them.")
    for formula, mistake in TRAFFIC_MISTAKES:
        if all(_same(answer, formula(p, n)) for answer, (_, p, n, _) in zip(answers, cases, strict=True)):
            return not_yet(mistake)
    if all(len({a for a, case in zip(answers, cases, strict=True) if case[0] == name}) == 1 for name, *_ in cases):
        return not_yet("your answer does not change with the number of devices: every device but the first gets its "
                       "own copy of the weights and sends its own gradients back.")
    answer, (name, parameter_bytes, num_devices, expected) = next(
        (a, case) for a, case in zip(answers, cases, strict=True) if a != case[3])
    return not_yet(f"{name}, {num_devices} devices, {parameter_bytes:,} parameter bytes: you said {answer:,.0f}, our "
                   f"rebuild's Broadcast moved {expected:,} bytes. Count per device: what does each device other than "
                   f"0 receive, and what does it send back?")


def plot_dp_iteration(phase_seconds: dict[str, float], devices: int, title: str):
    """An iteration of our rebuild, phase by phase in the order they run (seconds per phase, e.g. medians over
    iterations): the phases every device runs at once on its own thread (forward, backward) on every device's row;
    the rest on device 0's alone."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(9, 1.5 + 0.45 * devices), dpi=80, layout="constrained")
    start = 0.0
    for index, (phase, seconds) in enumerate(phase_seconds.items()):
        rows = range(devices) if phase in ("forward", "backward") else [0]
        for row in rows:
            ax.broken_barh([(start, max(1000 * seconds, 0.01))], (row - 0.4, 0.8), color=f"C{index}",
                           edgecolor="white", label=phase if row == 0 else None)
        start += 1000 * seconds
    ax.set_yticks(range(devices), [f"device {d}" for d in range(devices)])
    ax.invert_yaxis()
    ax.set(xlabel="milliseconds since the iteration began", title=title)
    ax.legend(ncol=len(phase_seconds), fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.grid(axis="x", alpha=0.3)
    return ax


# ---------------------------------------------------------------------------- DDP: overlap, measured

Span = tuple[float, float]


def merge(spans: Sequence[Span]) -> list[Span]:
    """The union of time spans, as sorted spans that do not touch."""
    merged: list[list[float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(start, end) for start, end in merged]


def intersect(first: Sequence[Span], second: Sequence[Span]) -> list[Span]:
    """The time covered by both sets of spans."""
    first, second = merge(first), merge(second)
    both, i, j = [], 0, 0
    while i < len(first) and j < len(second):
        start, end = max(first[i][0], second[j][0]), min(first[i][1], second[j][1])
        if start < end:
            both.append((start, end))
        i, j = (i + 1, j) if first[i][1] < second[j][1] else (i, j + 1)
    return both


def subtract(spans: Sequence[Span], holes: Sequence[Span]) -> list[Span]:
    """The time in `spans` that is not in `holes`."""
    left = []
    for start, end in merge(spans):
        for hole_start, hole_end in merge(holes):
            if hole_end <= start or hole_start >= end:
                continue
            if hole_start > start:
                left.append((start, hole_start))
            start = max(start, hole_end)
        if start < end:
            left.append((start, end))
    return left


def total(spans: Sequence[Span]) -> float:
    return sum(end - start for start, end in merge(spans))


def issue_order(events: Sequence[dict]) -> dict[str, float]:
    """When, in one profiled DDP step (dp_vs_ddp_overlap.py events), the all-reduces were issued: counted in backward
    ops, which run one after another on the training thread, so the count does not depend on how busy the machine
    is. ops: the backward's ops; ops_after_first_issue: how many of them started after the first all-reduce was
    issued (the backward work left for communication to overlap); issued_before_last_op: the all-reduces issued
    before the backward's last op started."""
    ops = sorted(e["start_us"] for e in events if e["kind"] == "backward")
    issued = sorted(e["start_us"] for e in events if e["kind"] == "all-reduce issued")
    after = sum(start > issued[0] for start in ops) if issued else 0
    return {"ops": len(ops), "ops_after_first_issue": after, "share_after_first_issue": after / len(ops),
            "issued": len(issued), "issued_before_last_op": sum(start < ops[-1] for start in issued)}
