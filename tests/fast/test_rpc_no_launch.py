"""Lesson 05's helpers without a launch."""
from __future__ import annotations

from helpers.kit.rpc import worker_name


def test_worker_names_by_rank():
    assert [worker_name(rank) for rank in range(3)] == ["ps", "trainer1", "trainer2"]


def test_the_counter_check_reads_whether_add_kept_its_sleeps():
    """Review 05-2: without add()'s sleeps nothing overlaps and no lock is needed, so a serial, lockless counter
    would pass on its count alone; the check reads the learner's source for both sleeps."""
    from helpers import WORKERS
    from helpers.lessons.rpc import _sleeps_missing

    solution = (WORKERS / "rpc_counter_solution.py").read_text()
    assert not _sleeps_missing(solution)
    assert not _sleeps_missing(solution.replace("time.sleep(0.1)  # slow", "time.sleep( 0.1 )  # slow"))
    assert _sleeps_missing(solution.replace("            time.sleep(0.01)\n", ""))
    assert _sleeps_missing(solution.replace("        time.sleep(0.1)  # slow", "        pass  # slow"))
