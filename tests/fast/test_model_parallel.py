"""Lesson 07's library (helpers/lessons/model_parallel.py) and the exercise's check. The model_parallel_* workers are
launched, and asserted, by the lesson (notebooks/07_model_parallel.ipynb, under pytest --nbval); here only plain
functions, without launches."""

import pytest
import torch
from torch import nn

from helpers.kit.instruments import SavedActivations
from helpers.kit.models import mlp, split_stages
from helpers.lessons.model_parallel import (
    activation_bytes,
    bubble_fraction,
    check_stage_order,
    idle_fraction,
    measured_orders,
    memory_per_rank,
    pipeline_schedule,
    ran_orders,
    started_before_input,
    torch_1f1b_order,
)


def test_memory_per_rank_shards_one_more_part_per_mode():
    per_mode = [memory_per_rank(1000, 4, mode) for mode in ("ddp", "zero1", "zero2", "fsdp")]
    assert per_mode[0] == {"weights": 4000, "gradients": 4000, "optimizer state": 8000, "activations": 0}
    assert per_mode[1]["optimizer state"] == 2000 and per_mode[2]["gradients"] == 1000
    assert per_mode[3]["weights"] == 1000
    mixed = memory_per_rank(10, 1, "ddp", precision="mixed")
    assert mixed["weights"] == 20 and mixed["optimizer state"] == 120 and sum(mixed.values()) == 160
    assert memory_per_rank(10, 2, "zero1", precision="mixed")["optimizer state"] == 60  # master copy sharded too
    assert memory_per_rank(10, 1, "ddp", optimizer="sgd")["optimizer state"] == 0
    assert memory_per_rank(10, 8, "fsdp", activation_bytes=123)["activations"] == 123  # never sharded
    with pytest.raises(ValueError):
        memory_per_rank(10, 2, "zero3")


def test_pipeline_schedule_matches_the_formula_and_1f1b_holds_fewer():
    for stages in (2, 3, 4):
        for microbatches in (1, 2, 5, 8):
            gpipe = pipeline_schedule(stages, microbatches, "gpipe")
            assert gpipe["bubble"] == pytest.approx(bubble_fraction(stages, microbatches))
            assert gpipe["peak_in_flight"] == [microbatches] * stages
            if microbatches >= stages:
                one_f_one_b = pipeline_schedule(stages, microbatches, "1f1b")
                assert one_f_one_b["bubble"] == pytest.approx(bubble_fraction(stages, microbatches))
                assert one_f_one_b["peak_in_flight"] == [stages - s for s in range(stages)]
    assert pipeline_schedule(2, 2, "1f1b")["slots"] == [["F0", "F1", None, "B0", None, "B1"],
                                                        [None, "F0", "B0", "F1", "B1", None]]
    with pytest.raises(ValueError):
        pipeline_schedule(2, 2, "interleaved")


def test_measured_orders_ignore_delays_and_catch_early_starts():
    events = [{"rank": 0, "kind": "forward", "start": 0.0, "end": 1.0},
              {"rank": 1, "kind": "forward", "start": 1.1, "end": 2.1},
              {"rank": 1, "kind": "backward", "start": 2.1, "end": 3.0},
              {"rank": 0, "kind": "backward", "start": 5.2, "end": 6.1}]  # a long delay: same order
    assert measured_orders(events) == [["F0", "B0"], ["F0", "B0"]]
    assert started_before_input(events) == []
    assert idle_fraction(events[:2]) == pytest.approx(0.5, abs=0.03)
    overlapping = [dict(e) for e in events]
    overlapping[1]["start"] = 0.5  # rank 1 began its forward before rank 0's had ended
    assert started_before_input(overlapping) == ["F0 on rank 1"]


def test_saved_activations_counts_live_and_peak_bytes():
    model = mlp(8, 1)
    with SavedActivations(model) as saved:
        model(torch.rand(4, 1, 28, 28)).sum().backward()
    assert saved.bytes == saved.peak == activation_bytes(4, 8, 1) and saved.live == 0


def test_split_stages_keeps_every_layer_once_in_order_and_balances_parameters():
    model = mlp(8, 3)
    stages = split_stages(model, 2)
    # layer by layer, the very modules of the model: catches a split that repeats one layer and drops another
    assert [layer for stage in stages for layer in stage] == list(model)
    assert [len(stage) for stage in stages] == [2, 8]  # Linear(784, 8) holds 6,280 of 6,586 parameters: cut after it
    even = nn.Sequential(*[nn.Linear(4, 4) for _ in range(6)])
    assert [list(stage) for stage in split_stages(even, 3)] == [list(even[i:i + 2]) for i in (0, 2, 4)]


# What torch's Schedule1F1B ran in the lesson's run (2 stages), as ran_orders reads it from the timelines.
RAN = {(2, 2, 0): ["F0", "F1", "B0", "B1"], (2, 2, 1): ["F0", "B0", "F1", "B1"],
       (2, 4, 0): ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],
       (2, 4, 1): ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}


def one_f_one_b(stage, stages, microbatches, warmup_shortfall=0):
    warmup = max(0, min(microbatches, stages - stage - warmup_shortfall))
    order = [f"F{i}" for i in range(warmup)]
    for i in range(microbatches):
        order.append(f"B{i}")
        if warmup + i < microbatches:
            order.append(f"F{warmup + i}")
    return order


def gpipe(stage, stages, microbatches):
    return [f"F{i}" for i in range(microbatches)] + [f"B{i}" for i in range(microbatches)]


def backwards_bunched(stage, stages, microbatches):  # peak p - s, but two backwards in a row mid-way
    order = one_f_one_b(stage, stages, microbatches)
    if stage == 0 and stages == 2 and microbatches == 4:
        return ["F0", "F1", "B0", "B1", "F2", "F3", "B2", "B3"]
    return order


def warmup_too_short(stage, stages, microbatches):  # p - s - 1 forwards first: holds one micro-batch too few
    return one_f_one_b(stage, stages, microbatches, warmup_shortfall=1)


def backward_first(stage, stages, microbatches):  # the last stage runs B0 before F0
    order = one_f_one_b(stage, stages, microbatches)
    return order[1:2] + order[:1] + order[2:] if stage == stages - 1 else order


def forgets_last_backward(stage, stages, microbatches):
    return one_f_one_b(stage, stages, microbatches)[:-1]


def asks_pipeline_schedule(stage, stages, microbatches):  # the lesson's replay of torch's own listing: its answer
    return [a for a in pipeline_schedule(stages, microbatches, "1f1b")["slots"][stage] if a]


def asks_pipeline_schedule_renamed(stage, stages, microbatches):  # the same, through the module under another name
    import helpers.lessons.model_parallel as lesson

    replay = lesson.pipeline_schedule
    return [a for a in replay(stages, microbatches, "1f1b")["slots"][stage] if a]


def asks_torch_schedule(stage, stages, microbatches):  # torch's Schedule1F1B, asked directly
    from types import SimpleNamespace

    from torch.distributed.pipelining import Schedule1F1B

    Schedule1F1B(SimpleNamespace(num_stages=stages), n_microbatches=microbatches)
    return one_f_one_b(stage, stages, microbatches)


def simulated_1f1b(stage, stages, microbatches):  # right, built differently: step the rule one action at a time
    order, forwards, backwards = [], 0, 0
    while backwards < microbatches:
        if forwards < microbatches and forwards - backwards < stages - stage:
            order.append(f"F{forwards}")
            forwards += 1
        else:
            order.append(f"B{backwards}")
            backwards += 1
            if forwards < microbatches:
                order.append(f"F{forwards}")
                forwards += 1
    return order


def crashes(stage, stages, microbatches):
    raise IndexError("list index out of range")


@pytest.mark.parametrize(("wrong", "message"), [
    (lambda *args: None, "stage 0 of 2, 4 micro-batches: return a list of strings"),
    (gpipe, "stage 0 of 2, 4 micro-batches: your order holds 4 micro-batches' activations at its peak; "
            "1F1B holds min(m, p - s) = 2"),
    (forgets_last_backward, "missing ['B3'], extra or repeated []"),
    (warmup_too_short, "stage 0 of 2, 4 micro-batches: your order holds 1 micro-batch's activations at its peak; "
                       "1F1B holds min(m, p - s) = 2"),
    (backward_first, "stage 1 of 2, 4 micro-batches: B0 comes before F0"),
    (backwards_bunched, "stage 0 of 2, 4 micro-batches: at position 3 you run B1, where torch's Schedule1F1B, run "
                        "in this lesson, ran F2 (after the warm-up, alternate one backward and one forward). Your "
                        "order up to there: ['F0', 'F1', 'B0', 'B1']."),
    (asks_pipeline_schedule, "stage_order asked pipeline_schedule for the order"),
    (asks_pipeline_schedule_renamed, "stage_order asked pipeline_schedule for the order"),
    (asks_torch_schedule, "stage_order asked torch's pipelining schedules (Schedule1F1B) for the order"),
    (crashes, "stage_order raised IndexError: list index out of range (line 2 of crashes: "
              "`raise IndexError(\"list index out of range\")`)"),
    (lambda s, p, m: list(reversed(one_f_one_b(s, p, m))), "the forwards must run in micro-batch order"),
])
def test_stage_order_check_says_what_is_wrong(capsys, wrong, message):
    assert not check_stage_order(wrong, RAN)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and message in out, out


def test_a_wrong_order_hint_shows_the_first_difference_not_the_answer(capsys):
    assert not check_stage_order(backwards_bunched, RAN)
    out = capsys.readouterr().out
    assert "expected" not in out and str(RAN[(2, 4, 0)]) not in out, out


def test_the_last_stage_of_four_is_held_to_the_rules(capsys):
    def wrong_last_stage(stage, stages, microbatches):  # right everywhere but on the last of 4 stages
        return gpipe(stage, stages, microbatches) if (stage, stages) == (3, 4) else one_f_one_b(stage, stages,
                                                                                                microbatches)
    assert not check_stage_order(wrong_last_stage, RAN)
    assert "stage 3 of 4, 8 micro-batches: your order holds 8" in capsys.readouterr().out


def test_stage_order_check_accepts_1f1b_and_matches_torch(capsys):
    assert check_stage_order(one_f_one_b, RAN)
    assert capsys.readouterr().out.startswith("Correct: ")
    assert check_stage_order(simulated_1f1b, RAN)  # the rule stepped action by action: right, built differently
    assert capsys.readouterr().out.startswith("Correct: ")
    for stages, microbatches in ((2, 4), (3, 5), (4, 8)):
        for stage in range(stages - 1):
            assert torch_1f1b_order(stages, microbatches, stage) == one_f_one_b(stage, stages, microbatches)
    with pytest.raises(ValueError):
        torch_1f1b_order(4, 8, 3)


def test_ran_orders_reads_the_timelines():
    events = [{"rank": 0, "kind": "forward", "start": 0.0, "end": 1.0},
              {"rank": 1, "kind": "forward", "start": 1.0, "end": 2.0},
              {"rank": 1, "kind": "backward", "start": 2.0, "end": 3.0},
              {"rank": 0, "kind": "backward", "start": 3.0, "end": 4.0}]
    timelines = [{"1f1b m=1": events[:1] + events[3:]}, {"1f1b m=1": events[1:3]}]
    assert ran_orders(timelines) == {(2, 1, 0): ["F0", "B0"], (2, 1, 1): ["F0", "B0"]}


def test_1f1b_slots_come_from_torchs_own_schedule():
    # The slot model reads 1F1B from torch's Schedule1F1B.pipeline_order; the last stage's forwards are renumbered
    # from F0 (torch 2.14.1 lists F1..Fm there), and torch refuses fewer micro-batches than stages.
    for stage in range(3):
        ours = [action for action in pipeline_schedule(4, 8, "1f1b")["slots"][stage] if action]
        assert ours == torch_1f1b_order(4, 8, stage)
    last = [action for action in pipeline_schedule(4, 8, "1f1b")["slots"][3] if action]
    assert last == [action for i in range(8) for action in (f"F{i}", f"B{i}")]
    with pytest.raises(ValueError, match="at least as many micro-batches as stages"):
        pipeline_schedule(3, 2, "1f1b")


def test_stopwatch_gives_the_first_stage_no_input_gradient():
    """A first stage (plain data) is timed without computing its input's gradient; a later stage is marked once."""
    from torch import nn

    from helpers.kit.instruments import Stopwatch

    input_gradients = []

    class Probe(torch.autograd.Function):  # identity that notes every gradient computed for the stage's input
        @staticmethod
        def forward(ctx, tensor):
            return tensor.view_as(tensor)

        @staticmethod
        def backward(ctx, grad):
            input_gradients.append(grad)
            return grad

    class ProbeInput(nn.Module):
        def forward(self, tensor):
            return Probe.apply(tensor)

    first = Stopwatch(nn.Sequential(ProbeInput(), nn.Flatten(), nn.Linear(784, 8)))
    images = torch.rand(4, 1, 28, 28)
    outputs = [first(chunk) for chunk in images.chunk(2)]
    for output in outputs:
        output.sum().backward()
    # Catches an instrument that makes the first stage's input require a gradient (as torch's PipelineStage does not)
    assert input_gradients == []
    assert [kind for kind, _, _ in first.intervals()] == ["forward", "forward", "backward", "backward"]
    assert all(start <= end for _, start, end in first.intervals()) and len(first.cpu_seconds()) == 4

    later = Stopwatch(nn.Linear(8, 2))
    activations = torch.rand(4, 8, requires_grad=True)
    later(activations).sum().backward()
    assert activations.grad is not None  # a later stage still sends its input's gradient back
    assert [kind for kind, _, _ in later.intervals()] == ["forward", "backward"]  # no second backward mark


def test_pipeline_step_prediction_is_the_bubble_formula_in_step_time():
    from helpers.lessons.model_parallel import pipeline_step_prediction

    # (m + p - 1) slots of 1/m of a stage against p slots at m = 1: the busy share is 1 - bubble at every m
    for stages in (2, 4):
        for microbatches in (1, 2, 4, 8):
            ratio = pipeline_step_prediction(1.0, microbatches, stages)
            assert ratio * stages * (1 - bubble_fraction(stages, microbatches)) == pytest.approx(1.0)
    assert pipeline_step_prediction(0.2, 4) == pytest.approx(0.2 * 5 / 8)


def test_speed_figure_draws_the_medians_their_spreads_the_formula_and_the_control():
    import matplotlib.pyplot as plt

    from helpers.kit.timing import Timing
    from helpers.lessons.model_parallel import speed_figure

    timings = {f"wide m={m}": Timing(f"wide m={m}", [0.3 / m + 0.1, 0.4 / m + 0.1, 0.35 / m + 0.1] * 2)
               for m in (1, 2, 4)}
    timings["wide m=4, one core"] = Timing("wide m=4, one core", [0.5, 0.6, 0.55, 0.5, 0.6])
    ax = speed_figure(timings)
    measured = ax.lines[0]  # the first line drawn: the medians (errorbar's data line)
    assert list(measured.get_xdata()) == [1, 2, 4]
    assert [round(y, 6) for y in measured.get_ydata()] == [round(timings[f"wide m={m}"].median() * 1e3, 6)
                                                          for m in (1, 2, 4)]
    dashed = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert len(dashed) == 1 and dashed[0].get_ydata()[-1] == pytest.approx(measured.get_ydata()[0] * 5 / 8)
    assert "m = 4, both ranks on one core" in [text.get_text() for text in ax.get_legend().get_texts()]
    plt.close(ax.figure)
