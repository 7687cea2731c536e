"""Lesson 03's workers, where the lesson does not assert them, at their smallest sizes: the overlap worker's
--profiled steps and their events, the options worker's copies, and that every timed setting of the overlap, options
and speed workers takes its turns (the speed worker's equal weights too). The rest of the dp_vs_ddp_* workers are
launched, and asserted, by the lesson (notebooks/03_dataparallel_vs_ddp.ipynb, under pytest --nbval); the CPU rebuild
of DataParallel, when DDP issues its all-reduces and the exercise's check, which launch nothing, are tested in
tests/fast/test_dp_vs_ddp_no_launch.py."""
from __future__ import annotations

import pytest

from helpers import WORKERS, launch
from helpers.kit.timing import across_ranks


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_overlap_worker_takes_turns_and_returns_profiled_steps_with_every_kind_of_event() -> None:
    """--profiled and --turn-steps, which the lesson never passes; events of all three kinds in every profiled step;
    a backward wall time and thread CPU time for every timed backward; 5 rounds for every setting."""
    run = launch(WORKERS / "dp_vs_ddp_overlap.py", nproc=2, echo=False,
                 args=["--per-rank-batch", "4", "--rounds", "5", "--turn-steps", "1", "--profiled", "2"])
    res = run.results[0]
    assert sorted(res["profiled"]) == ["1 bucket", "4 buckets"]
    for profiled in res["profiled"].values():
        assert len(profiled["steps"]) == len(profiled["backward_cpu"]) == 2
        for events in profiled["steps"]:
            assert {e["kind"] for e in events} == {"backward", "all-reduce issued", "all-reduce running"}
    assert all(len(spans["wall"]) == len(spans["cpu"]) == 5 for spans in res["backward"].values())
    timings = across_ranks([run.results[rank]["timings"] for rank in (0, 1)])
    assert sorted(timings) == ["1 bucket", "4 buckets", "4 buckets, Python all-reduce hook", "4 buckets, no all-reduce"]
    assert all(len(t.wall) == len(t.cpu) == 5 for t in timings.values())


def test_options_worker_counts_the_reducers_copies_for_both_ways_of_zeroing() -> None:
    """gradient_as_bucket_view: the gradients end in the buckets with set_to_none True and False, and the reducer
    copies every gradient only with True; a copy count of zero both ways would mean the profiler records nothing."""
    run = launch(WORKERS / "dp_vs_ddp_options.py", nproc=2, echo=False,
                 args=["--rounds", "5", "--turn-steps", "1", "--per-rank-batch", "4"])
    res = run.results[0]
    zeroing = {row["set_to_none"]: row for row in res["bucket_view_zeroing"]}
    buckets = res["gradient_as_bucket_view"]["buckets"]
    assert zeroing[True]["grad_storages"] == zeroing[False]["grad_storages"] == buckets
    assert zeroing[False]["reducer_copies"] == 0 < zeroing[True]["reducer_copies"] == zeroing[True]["parameters"]
    assert sorted(res["timings"]) == ["default", "find_unused_parameters", "gradient_as_bucket_view", "static_graph"]


def test_speed_worker_settings_take_turns_and_train_the_same_weights() -> None:
    """dp_vs_ddp_speed.py at its smallest: every setting takes 5 turns, rank 1 sits out the one-process settings
    (their time is rank 0's), and every setting ends with the control's weights."""
    run = launch(WORKERS / "dp_vs_ddp_speed.py", nproc=2, echo=False,
                 args=["--global-batch", "16", "--width", "32", "--depth", "3", "--rounds", "5", "--turn-steps", "1"])
    res = run.results[0]
    assert res["what"] == ["DDP, 2 processes", "our DataParallel, 2 threads", "1 process, 2 threads",
                           "1 process, 1 thread"]
    assert len(set(res["steps"].values())) == 1 and max(res["weights_diff"].values()) < 1e-5
    timings = across_ranks([run.results[rank]["timings"] for rank in (0, 1)])
    assert all(len(t.wall) == 5 for t in timings.values())
    assert max(run.results[1]["timings"]["1 process, 1 thread"]["wall"]) < min(timings["1 process, 1 thread"].wall)
