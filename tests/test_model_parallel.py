"""Lesson 07's workers and helpers/model_parallel.py at the smallest sizes that show the behaviour."""
from pathlib import Path

import pytest

from helpers import launch
from helpers.model_parallel import (
    MIXED_ADAM,
    activation_bytes,
    bubble_fraction,
    check_smallest_stage,
    idle_fraction,
    mlp,
    split_stages,
    zero_bytes_per_rank,
)

WORKERS = Path(__file__).resolve().parent.parent / "helpers" / "workers"


def test_zero_formula_shards_one_more_part_per_stage():
    per_stage = [zero_bytes_per_rank(1000, 4, stage) for stage in range(4)]
    assert per_stage[0] == {"params": 4000, "grads": 4000, "optimizer": 8000}
    assert per_stage[1]["optimizer"] == 2000 and per_stage[2]["grads"] == 1000 and per_stage[3]["params"] == 1000
    assert sum(zero_bytes_per_rank(10, 1, 3, MIXED_ADAM).values()) == 160
    with pytest.raises(ValueError):
        zero_bytes_per_rank(10, 2, 4)


def test_bubble_split_and_exercise_check(capsys):
    assert bubble_fraction(2, 1) == 0.5 and bubble_fraction(4, 1) == 0.75 and bubble_fraction(2, 3) == 0.25
    stages = split_stages(mlp(8, 3), 2)
    assert sum(len(s) for s in stages) == len(mlp(8, 3)) and len(stages) == 2
    assert not check_smallest_stage(lambda *args: None)
    assert "Not yet" in capsys.readouterr().out
    events = [{"rank": 0, "kind": "forward", "start": 0.0, "end": 1.0},
              {"rank": 1, "kind": "forward", "start": 1.0, "end": 2.0}]
    assert idle_fraction(events) == 0.5


def test_memory_matches_zero_formulas():
    run = launch(WORKERS / "model_parallel_memory.py", nproc=2, echo=False,
                 args=["--width", 16, "--hidden-layers", 1, "--global-batch", 8])
    n_params = run.results[0]["n_params"]
    for rank in range(2):
        held = run.results[rank]
        assert held["ddp"]["optimizer"] == zero_bytes_per_rank(n_params, 2, 0)["optimizer"]
        assert held["fsdp"]["params"] == zero_bytes_per_rank(n_params, 2, 3)["params"]
        assert held["zero1"]["optimizer"] < held["ddp"]["optimizer"]
        assert held["ddp"]["activations"] == held["fsdp"]["activations"] == activation_bytes(4, 16, 1)


def test_naive_and_pipeline_equal_unsplit_model():
    naive = launch(WORKERS / "model_parallel_naive.py", nproc=2, echo=False, args=["--width", 16, "--batch", 8, "--repeats", 1])
    assert naive.results[1]["loss_diff"] < 1e-6 and max(r["grad_diff"] for r in naive.results.values()) < 1e-6
    kinds = sorted(e["kind"] for r in naive.results.values() for e in r["events"])
    assert kinds == ["backward", "backward", "forward", "forward"]
    pipe = launch(WORKERS / "model_parallel_pipeline.py", nproc=2, echo=False,
                  args=["--width", 16, "--batch", 8, "--microbatches", 2])
    checks = pipe.results[1]["checks"]
    assert set(checks) == {"gpipe m=2", "1f1b m=2"} and all(c["loss_diff"] < 1e-6 for c in checks.values())
    assert len(pipe.results[0]["timelines"]["gpipe m=2"]) == 4  # 2 micro-batches x (forward, backward)


def test_fsdp_shards_counts_and_matches_ddp():
    run = launch(WORKERS / "model_parallel_fsdp.py", nproc=2, echo=False, args=["--width", 8, "--hidden-layers", 0, "--steps", 2])
    result = run.results[0]
    assert result["shards"]["1.weight"] == {"full": [8, 784], "local": [4, 784]}
    assert result["traffic"][-1]["all_gather_single calls"] == 4  # 2 layers, gathered in forward and backward
    assert result["traffic"][-1]["reduce_scatter_single calls"] == 2
    assert max(r["max_param_diff"] for r in run.results.values()) < 1e-6


def test_tensor_parallel_equals_plain_layers():
    run = launch(WORKERS / "model_parallel_tensor.py", nproc=2, echo=False, args=["--features", 4, "--hidden", 8])
    assert run.results[1]["w1_shape"] == [4, 4] and run.results[1]["w2_shape"] == [4, 4]
    assert all(v < 1e-5 for r in run.results.values() for v in r["diffs"].values())
