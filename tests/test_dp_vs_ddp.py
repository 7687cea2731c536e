"""Lesson 03's workers, where the lesson does not assert them: the overlap worker's --profiled steps and their events,
the options worker's copies. The rest of the dp_vs_ddp_* workers are launched, and asserted, by the lesson
(notebooks/03_dataparallel_vs_ddp.ipynb, under pytest --nbval); the CPU rebuild of DataParallel, the overlap measure
and the exercise's check, which launch nothing, are tested in tests/fast/test_dp_vs_ddp_no_launch.py."""
from __future__ import annotations

import pytest

from helpers import WORKERS, launch
from helpers.lessons.dp_vs_ddp import overlap


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def test_overlap_worker_returns_profiled_steps_with_every_kind_of_event() -> None:
    """--profiled, which the lesson never passes; and events of all three kinds in every step (the lesson's control,
    an overlap below 5% with one bucket, would also pass if no all-reduce were recorded: overlap() gives 0 then)."""
    run = launch(WORKERS / "dp_vs_ddp_overlap.py", nproc=2,
                 args=["--bucket-cap-mb", "1", "--per-rank-batch", "4", "--steps", "3", "--profiled", "2"], echo=False)
    res = run.results[0]
    assert len(res["steps"]) == 2
    for events in res["steps"]:
        assert {e["kind"] for e in events} == {"backward", "all-reduce issued", "all-reduce running"}
        assert 0 <= overlap(events)["fraction"] <= 1


def test_options_worker_counts_the_reducers_copies_for_both_ways_of_zeroing() -> None:
    """gradient_as_bucket_view: the gradients end in the buckets with set_to_none True and False, and the reducer
    copies every gradient only with True; a copy count of zero both ways would mean the profiler records nothing."""
    run = launch(WORKERS / "dp_vs_ddp_options.py", nproc=2, args=["--steps", "3", "--per-rank-batch", "4"], echo=False)
    res = run.results[0]
    zeroing = {row["set_to_none"]: row for row in res["bucket_view_zeroing"]}
    buckets = res["gradient_as_bucket_view"]["buckets"]
    assert zeroing[True]["grad_storages"] == zeroing[False]["grad_storages"] == buckets
    assert zeroing[False]["reducer_copies"] == 0 < zeroing[True]["reducer_copies"] == zeroing[True]["parameters"]
