"""Lesson 07's workers and helpers/model_parallel.py at the smallest sizes that show the behaviour."""

import pytest
import torch

from helpers import WORKERS, launch
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


def test_memory_matches_formulas_and_measures_temporaries():
    run = launch(WORKERS / "model_parallel_memory.py", nproc=2, echo=False,
                 args=["--width", 16, "--hidden-layers", 1, "--global-batch", 8])
    n_params = run.results[0]["n_params"]
    for rank in range(2):
        held = run.results[rank]
        assert held["ddp"]["optimizer"] == memory_per_rank(n_params, 2, "ddp")["optimizer state"]
        assert held["fsdp"]["params"] == memory_per_rank(n_params, 2, "fsdp")["weights"]
        assert held["zero1"]["optimizer"] < held["ddp"]["optimizer"]
        assert held["ddp"]["activations"] == held["fsdp"]["activations"] == activation_bytes(4, 16, 1)
        assert held["ddp_buckets"]["copy"]["grads_and_buckets"] == 8 * n_params
        assert held["ddp_buckets"]["view"]["grads_and_buckets"] == 4 * n_params
        assert held["fsdp_gathered"]["keep"]["peak"] == 4 * n_params > held["fsdp_gathered"]["reshard"]["peak"]


def test_naive_and_pipeline_equal_unsplit_model_and_follow_the_schedule():
    naive = launch(WORKERS / "model_parallel_naive.py", nproc=2, echo=False,
                   args=["--width", 16, "--global-batch", 8, "--steps", 1, "--stage-ms", 80])
    assert naive.results[1]["loss_diff"] < 1e-6 and max(r["grad_diff"] for r in naive.results.values()) < 1e-6
    events = [e for r in naive.results.values() for e in r["events"]]
    assert measured_slots(events) == pipeline_schedule(2, 1)["slots"]
    pipe = launch(WORKERS / "model_parallel_pipeline.py", nproc=2, echo=False,
                  args=["--width", 16, "--global-batch", 8, "--microbatches", 2, "--stage-ms", 120])
    checks = pipe.results[1]["checks"]
    assert set(checks) == {"gpipe m=2", "1f1b m=2"} and all(c["loss_diff"] < 1e-6 for c in checks.values())
    for key in checks:
        schedule = key.split()[0]
        assert measured_slots(pipe.results[0]["timelines"][key] + pipe.results[1]["timelines"][key]) \
            == pipeline_schedule(2, 2, schedule)["slots"]
        in_flight = [pipe.results[r]["activations"][key]["peak"] / pipe.results[r]["activations"][key]["per_microbatch"]
                     for r in range(2)]
        assert in_flight == pipeline_schedule(2, 2, schedule)["peak_in_flight"]


def test_fsdp_shards_counts_matches_ddp_and_gathers_bf16():
    run = launch(WORKERS / "model_parallel_fsdp.py", nproc=2, echo=False,
                 args=["--width", 8, "--hidden-layers", 0, "--steps", 2])
    result = run.results[0]
    assert result["shards"]["1.weight"] == {"full": [8, 784], "local": [4, 784]}
    assert result["traffic"][-1]["all_gather_single calls"] == 4  # 2 layers, gathered in forward and backward
    assert result["traffic"][-1]["reduce_scatter_single calls"] == 2
    assert 2 * result["bf16_traffic"]["all_gather_single bytes"] == result["traffic"][-1]["all_gather_single bytes"]
    assert max(r["max_param_diff"] for r in run.results.values()) < 1e-6


def test_tensor_parallel_equals_plain_layers_by_hand_and_with_the_api():
    run = launch(WORKERS / "model_parallel_tensor.py", nproc=2, echo=False, args=["--features", 4, "--hidden", 8])
    assert run.results[1]["w1_shape"] == [4, 4] and run.results[1]["w2_shape"] == [4, 4]
    assert all(v < 1e-5 for r in run.results.values() for v in r["diffs"].values())
    api = run.results[1]["api"]
    assert api["w1_local"] == [4, 4] and api["collectives"] == {"all_reduce": 2}
    assert all(v < 1e-5 for r in run.results.values() for v in r["api"]["diffs"].values())
