"""Lesson 07's library (helpers/model_parallel.py) and the exercise's check. The model_parallel_* workers are
launched, and asserted, by the lesson (notebooks/07_model_parallel.ipynb, under pytest --nbval); here only plain
functions, without launches."""

import pytest
import torch

from helpers.instruments import SavedActivations
from helpers.model_parallel import (
    activation_bytes,
    bubble_fraction,
    check_smallest_mode,
    idle_fraction,
    measured_slots,
    memory_per_rank,
    pipeline_schedule,
)
from helpers.models import mlp, split_stages


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


def test_measured_slots_round_small_delays_away():
    events = [{"rank": 0, "kind": "forward", "start": 0.0, "end": 1.0},
              {"rank": 1, "kind": "forward", "start": 1.1, "end": 2.1},
              {"rank": 1, "kind": "backward", "start": 2.1, "end": 3.0},
              {"rank": 0, "kind": "backward", "start": 3.2, "end": 4.1}]
    assert measured_slots(events) == pipeline_schedule(2, 1)["slots"]
    assert idle_fraction(events[:2]) == pytest.approx(0.5, abs=0.03)


def test_saved_activations_counts_live_and_peak_bytes():
    model = mlp(8, 1)
    with SavedActivations(model) as saved:
        model(torch.rand(4, 1, 28, 28)).sum().backward()
    assert saved.bytes == saved.peak == activation_bytes(4, 8, 1) and saved.live == 0


def test_split_and_exercise_check(capsys):
    stages = split_stages(mlp(8, 3), 2)
    assert sum(len(s) for s in stages) == len(mlp(8, 3)) and len(stages) == 2
    assert not check_smallest_mode(lambda *args: None)
    assert "Not yet" in capsys.readouterr().out
    assert not check_smallest_mode(lambda *args: "fsdp")  # always the most sharding is wrong too
    assert check_smallest_mode(lambda n, w, b: next(
        (m for m in ("ddp", "zero1", "zero2", "fsdp")
         if sum(memory_per_rank(n, w, m, precision="mixed").values()) <= b), None))
