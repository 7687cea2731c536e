"""Lesson 05's RPC workers at the smallest size that shows each behaviour (real launches)."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import WorkerFailed, launch
from helpers.rpc_ps import check_counter, worker_name

WORKERS = Path(__file__).resolve().parent.parent / "helpers" / "workers"


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LESSONS_DATA", "digits")


def test_worker_names_by_rank():
    assert [worker_name(rank) for rank in range(3)] == ["ps", "trainer1", "trainer2"]


def test_basics_remote_calls_and_references():
    run = launch(WORKERS / "rpc_basics.py", nproc=2, echo=False, timeout=120)
    facts = run.results[0]
    assert facts["sync"] == "worker1 received [0, 1, 2]"
    assert facts["async"] == [0, 1, 4, 9]
    assert (facts["owner"], facts["is_owner"]) == ("worker1", False)
    # to_here() gave a copy (the +100 on it is lost); local_value() on the owner changed the original
    assert facts["after_double"] == [[2.0, 2.0], [2.0, 2.0]] and facts["remote_sum"] == 8.0
    assert "shutdown_seconds" in run.results[1]


def test_parameter_server_trainers_update_the_server_model():
    run = launch(WORKERS / "rpc_parameter_server.py", nproc=3, args=["--steps", 20], echo=False, timeout=180)
    for rank in (1, 2):
        assert [step for step, _ in run.metric("loss", rank=rank)] == list(range(20))
        assert run.results[rank]["steps"] == 20
    # untrained, SimpleModel is near chance (about 10%); the trainers' gradients reached the server
    assert run.results[0]["test_accuracy"] > 0.2


def test_batched_server_takes_one_step_per_round():
    run = launch(WORKERS / "rpc_batched_server.py", nproc=3, args=["--steps", 20], echo=False, timeout=180)
    assert run.results[0]["optimizer_steps"] == 20
    assert run.results[0]["test_accuracy"] > 0.2


def test_dead_trainer_fails_the_launch_with_its_traceback():
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "rpc_parameter_server.py", nproc=3, args=["--steps", 12, "--crash-rank", 2],
               echo=False, timeout=120)
    assert caught.value.rank == 2 and caught.value.exitcode == 1
    assert "trainer2 crashed at step 5 (simulated)" in str(caught.value)


def test_counter_solution_passes_its_check():
    assert check_counter(str(WORKERS / "rpc_counter_solution.py")).startswith("Correct")
