"""Library code for lesson 07 (when the model does not fit): memory accounting, pipeline schedules, timelines.

    from helpers.lessons.model_parallel import memory_per_rank, pipeline_schedule
    memory_per_rank(n_params=1_000_000, world_size=2, mode="fsdp")    # bytes per rank by part
    pipeline_schedule(stages=2, microbatches=4, schedule="1f1b")        # slots, bubble, peak in flight

The notebook imports the formulas, `measured_orders` and the exercise's check; the instruments its workers use
(`SavedActivations`, `SimulatedWork`, `Stopwatch`) are in helpers/kit/instruments.py, `own_bytes` in
helpers/kit/tensors.py, the model (`mlp`) and `split_stages` in helpers/kit/models.py, and `plot_timeline` in
helpers/lessons/plots.py.
Taught in notebooks/07_model_parallel.ipynb.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from helpers.kit.timing import Timing

# What one rank keeps per parameter, in bytes, for each precision (the optimizer's own state comes on top). fp32 and
# autocast are the same here: autocast (torch.amp) keeps fp32 weights and gradients. Its 16-bit weight casts are not
# resting state, but they are not free either: autograd saves the cast of every layer whose input needs a gradient until
# that layer's backward, so they add to the activations (the lesson measures it). "mixed" is the ZeRO paper's count
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
    """The order in which one stage runs its forwards (F0, F1, ...) and backwards (B0, B1, ...).

    GPipe: all forwards, then all backwards (ScheduleGPipe). 1F1B: not written here but read from torch's own
    Schedule1F1B (its `pipeline_order`, see `_torch_1f1b_list`), which needs microbatches >= stages.
    """
    if schedule == "gpipe":
        return [f"F{i}" for i in range(microbatches)] + [f"B{i}" for i in range(microbatches)]
    if schedule != "1f1b":
        raise ValueError(f"schedule must be 'gpipe' or '1f1b', not {schedule!r}")
    listed = _torch_1f1b_list(stages, microbatches, stage)
    if stage == stages - 1:  # torch 2.14.1 numbers the last stage's forwards from 1: renumber them from 0
        listed = [f"F{int(action[1:]) - 1}" if action[0] == "F" else action for action in listed]
    return listed


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


def measured_orders(events: Sequence[dict[str, Any]]) -> list[list[str]]:
    """The order in which each rank ran its actions, from measured intervals {rank, kind, start, end}.

    Micro-batches are numbered in the order each rank ran them (GPipe and 1F1B both run forwards, and
    backwards, in micro-batch order). Gaps are ignored: a busy machine can delay an action, not reorder it.
    """
    orders = []
    for rank in sorted({e["rank"] for e in events}):
        counts = {"forward": 0, "backward": 0}
        order = []
        for event in sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start"]):
            order.append(f"{event['kind'][0].upper()}{counts[event['kind']]}")
            counts[event["kind"]] += 1
        orders.append(order)
    return orders


def started_before_input(events: Sequence[dict[str, Any]]) -> list[str]:
    """Actions that started before their input was there (forward i on stage s needs stage s-1's forward i to
    have ended; backward i needs stage s+1's backward i). An empty list: every stage waited for its input."""
    orders = measured_orders(events)
    ranks = sorted({e["rank"] for e in events})
    timed = {}
    for rank, order in zip(ranks, orders, strict=True):
        ran = sorted((e for e in events if e["rank"] == rank), key=lambda e: e["start"])
        timed.update({(rank, action): event for action, event in zip(order, ran, strict=True)})
    early = []
    for (rank, action), event in timed.items():
        source = (rank - 1 if action[0] == "F" else rank + 1, action)
        if source in timed and event["start"] < timed[source]["end"]:
            early.append(f"{action} on rank {rank}")
    return early


def idle_fraction(events: Sequence[dict[str, Any]]) -> float:
    """Share of rank-time idle: 1 - (time the ranks spent computing) / (step span x ranks).

    Events are {rank, kind, start, end}. A rank-second counts as idle when that rank is not computing, whatever
    the other ranks do (it is not the share of the step in which no rank computes).
    """
    begin = min(e["start"] for e in events)
    span = max(e["end"] for e in events) - begin
    ranks = {e["rank"] for e in events}
    busy = sum(e["end"] - e["start"] for e in events)
    return 1 - busy / (span * len(ranks))


def pipeline_step_prediction(step_at_one: float, microbatches: int, stages: int = 2) -> float:
    """The bubble formula's step time at m micro-batches from the step at m = 1, for equal stages and nothing but
    compute: (m + p - 1) slots of 1/m of a stage's whole-batch time, against p of them at m = 1."""
    return step_at_one * (microbatches + stages - 1) / (microbatches * stages)


def speed_figure(timings: Mapping[str, Timing], prefix: str = "wide m=", control: str = "wide m=4, one core") -> Any:
    """Step time against micro-batches from a pipeline speed run: each setting's median wall time with a bar from
    its lowest to its highest round, the formula's prediction from the m = 1 median, and the one-core control."""
    import matplotlib.pyplot as plt

    from helpers.lessons.plots import plain_log_ticks

    counts = sorted(int(name[len(prefix):]) for name in timings if name.startswith(prefix) and "," not in name)
    medians = [timings[f"{prefix}{m}"].median() * 1e3 for m in counts]
    spreads = [[medians[i] - timings[f"{prefix}{m}"].spread()[0] * 1e3 for i, m in enumerate(counts)],
               [timings[f"{prefix}{m}"].spread()[1] * 1e3 - medians[i] for i, m in enumerate(counts)]]
    _, ax = plt.subplots(figsize=(6.4, 3.6), dpi=80, layout="constrained")
    ax.errorbar(counts, medians, yerr=spreads, marker="o", capsize=4, label="measured (median, lowest-highest)")
    ax.plot(counts, [pipeline_step_prediction(medians[0], m) for m in counts], linestyle="--",
            label="formula, from the m = 1 step")
    if control in timings:
        low, high = (value * 1e3 for value in timings[control].spread())
        middle = timings[control].median() * 1e3
        at = int(control[len(prefix):].split(",")[0])
        ax.errorbar([at], [middle], yerr=[[middle - low], [high - middle]], marker="s", capsize=4, color="tab:red",
                    linestyle="none", label=f"m = {at}, both ranks on one core")
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="step time, ms (wall)", ylim=(0, None),
           title="GPipe, 2 stages of real compute: step time")
    plain_log_ticks(ax, counts)
    ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return ax


def _torch_1f1b_list(stages: int, microbatches: int, stage: int) -> list[str]:
    """The forwards and backwards torch's Schedule1F1B lists in its `pipeline_order` for `stage`, as listed."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B
    from torch.distributed.pipelining.schedules import _ComputationType

    if microbatches < stages:
        raise ValueError(f"torch's Schedule1F1B needs at least as many micro-batches as stages "
                         f"({microbatches} < {stages})")
    kinds = {_ComputationType.FORWARD: "F", _ComputationType.FULL_BACKWARD: "B"}
    schedule = Schedule1F1B(SimpleNamespace(num_stages=stages), n_microbatches=microbatches)
    return [f"{kinds[action.computation_type]}{action.microbatch_index}"
            for action in schedule.pipeline_order[stage] if action is not None and action.computation_type in kinds]


def torch_1f1b_order(stages: int, microbatches: int, stage: int) -> list[str]:
    """The forwards and backwards that torch's own Schedule1F1B lists for `stage`, in order ("F0", "B0", ...).

    Read from the schedule's `pipeline_order` (`Schedule1F1B._get_pipeline_order` in
    torch/distributed/pipelining/schedules.py), which needs only the number of stages, not a process group.
    For the last stage that list numbers the forwards from 1 (in torch 2.14.1 it lists F1..Fm, not F0..F(m-1)),
    so use it for the other stages only.
    """
    if stage >= stages - 1:
        raise ValueError("torch's pipeline_order misnumbers the last stage's forwards; compare the other stages")
    return _torch_1f1b_list(stages, microbatches, stage)


def ran_orders(timelines: Sequence[dict[str, list[dict[str, Any]]]], schedule: str = "1f1b") -> dict:
    """{(stages, microbatches, stage): the actions that stage ran, in order} from a pipeline run's timelines."""
    orders = {}
    for key in timelines[0]:
        name, microbatches = key.split(" m=")
        if name != schedule:
            continue
        rows = measured_orders([event for timeline in timelines for event in timeline[key]])
        for stage, row in enumerate(rows):
            orders[(len(rows), int(microbatches), stage)] = row
    return orders


def _your_line(function: Any, error: BaseException) -> str:
    """' (line N of stage_order: `text`)' for the deepest frame of the traceback inside `function`'s own code."""
    import linecache
    import traceback

    code = getattr(function, "__code__", None)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if code is not None and frame.filename == code.co_filename and frame.lineno is not None]
    if not frames:
        return ""
    frame = frames[-1]
    text = (frame.line or linecache.getline(frame.filename, frame.lineno)).strip()
    return f" (line {frame.lineno - code.co_firstlineno + 1} of {function.__name__}: `{text}`)"


def _micro_batches(count: int) -> str:
    return f"{count} micro-batch's" if count == 1 else f"{count} micro-batches'"


def _asks_for_the_answer(stage_order: Any, *args: int) -> tuple[Any, str | None]:
    """Call stage_order(*args); also say whether it asked the lesson's schedule model or torch's schedules for
    1F1B's order (then it returns torch's answer, not a rule of its own). Every Python call made while it runs is
    seen by a profile function, so calling them under another name or through another module is seen too."""
    import sys

    import torch.distributed.pipelining.schedules as torch_schedules

    answers = {pipeline_schedule.__code__: "pipeline_schedule", _stage_order.__code__: "pipeline_schedule",
               torch_1f1b_order.__code__: "torch_1f1b_order", _torch_1f1b_list.__code__: "torch_1f1b_order"}
    schedules_file = torch_schedules.__file__
    asked: list[str] = []

    def profile(frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code in answers:
                asked.append(answers[code])
            elif code.co_filename == schedules_file:
                asked.append("torch's pipelining schedules (Schedule1F1B)")

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        got = stage_order(*args)
    finally:
        sys.setprofile(previous)
    return got, (asked[0] if asked else None)


def check_stage_order(stage_order: Any, ran: dict[tuple[int, int, int], list[str]]) -> bool:
    """Exercise check: does stage_order(stage, stages, microbatches) give the order 1F1B runs on that stage?

    `ran` holds what torch's Schedule1F1B ran in this lesson's pipeline run (2 stages); for 3 and 4 stages the
    reference is torch's own `pipeline_order` (`torch_1f1b_order`) for every stage but the last, and the rules
    below for the last. A stage_order that asks pipeline_schedule or torch's schedules for the order is refused:
    their 1F1B rows are torch's answer, not the learner's rule.
    """
    from helpers.lessons.checks import correct, not_yet

    # The 4-micro-batch cases first: short enough to read, and GPipe and 1F1B differ there on every stage.
    cases = sorted(ran, key=lambda case: (case[1] != 4, case))
    cases += [(stages, m, s) for stages, m in ((3, 5), (4, 8)) for s in range(stages)]
    for stages, microbatches, stage in cases:
        where = f"stage {stage} of {stages}, {microbatches} micro-batches"
        try:
            got, asked = _asks_for_the_answer(stage_order, stage, stages, microbatches)
        except Exception as error:  # the learner's code: say what it raised, and on which of its lines
            return not_yet(f"{where}: stage_order raised {type(error).__name__}: {error}"
                           f"{_your_line(stage_order, error)}")
        if asked:
            return not_yet(f"{where}: stage_order asked {asked} for the order. Its 1F1B rows are read from torch's "
                           "own Schedule1F1B: returning them passes torch's answer, not yours. Build the list from "
                           "1F1B's rule (section 4) without calling the lesson's or torch's schedules.")
        if not isinstance(got, list) or not all(isinstance(action, str) for action in got):
            return not_yet(f"{where}: return a list of strings like ['F0', 'F1', 'B0', ...], not {got!r}.")
        wanted = [f"F{i}" for i in range(microbatches)] + [f"B{i}" for i in range(microbatches)]
        missing = [a for a in wanted if a not in got]
        extra = sorted({a for a in got if a not in wanted or got.count(a) > 1})
        if missing or extra:
            return not_yet(f"{where}: every one of F0..F{microbatches - 1} and B0..B{microbatches - 1} runs exactly "
                           f"once; missing {missing}, extra or repeated {extra}.")
        for kind in "FB":
            runs = [a for a in got if a[0] == kind]
            if runs != sorted(runs, key=lambda a: int(a[1:])):
                return not_yet(f"{where}: the {'forwards' if kind == 'F' else 'backwards'} must run in micro-batch "
                               f"order, got {runs}.")
        early = next((f"B{i}" for i in range(microbatches) if got.index(f"B{i}") < got.index(f"F{i}")), None)
        if early:
            return not_yet(f"{where}: {early} comes before F{early[1:]}, but a backward needs its forward's "
                           f"activations. Got {got}.")
        held = _peak_in_flight(got)
        limit = min(microbatches, stages - stage)
        if held != limit:
            return not_yet(f"{where}: your order holds {_micro_batches(held)} activations at its peak; 1F1B holds "
                           f"min(m, p - s) = {limit} (how many forwards can stage s run before its first backward "
                           f"is due?). Got {got}.")
        reference = ran.get((stages, microbatches, stage))
        source = "torch's Schedule1F1B, run in this lesson, ran"
        if reference is None and stage < stages - 1:
            reference, source = torch_1f1b_order(stages, microbatches, stage), "torch's Schedule1F1B lists"
        if reference is not None and got != reference:
            position = next(i for i, (a, b) in enumerate(zip(got, reference, strict=True)) if a != b)
            return not_yet(f"{where}: at position {position} you run {got[position]}, where {source} "
                           f"{reference[position]} (after the warm-up, alternate one backward and one forward). "
                           f"Your order up to there: {got[:position + 1]}.")
    return correct(f"stage_order gives 1F1B's order in all {len(cases)} cases: the order torch ran for 2 stages and "
                   "listed for 3 and 4, with min(m, p - s) micro-batches held at most.")
