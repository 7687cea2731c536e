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


def test_the_counter_check_reads_whether_an_rref_holds_the_counter():
    """Review r0506-2, 05-1: a Counter made on worker1 by a plain rpc_sync and reached through module functions got
    "Correct"; the check now reads the source for remote(..., Counter). Right but different: rpc.remote with
    keywords, a bare `remote` imported from torch.distributed.rpc, and a function that returns a Counter."""
    from helpers import WORKERS
    from helpers.lessons.rpc import _counter_made_by_remote

    solution = (WORKERS / "rpc_counter_solution.py").read_text()
    made = 'rpc.remote(f"worker{1 % world_size}", Counter)'
    assert made in solution and _counter_made_by_remote(solution)
    assert _counter_made_by_remote(solution.replace(made, 'rpc.remote(to="worker1", func=Counter, args=())'))
    assert _counter_made_by_remote(solution.replace(made, 'remote("worker1", Counter)'))
    assert not _counter_made_by_remote(solution.replace(made, 'rpc.rpc_sync("worker1", make)'))
    assert _counter_made_by_remote(solution.replace(made, 'rpc.remote("worker1", make)'))  # a factory: an RRef too
    assert _counter_made_by_remote("def broken(:\n")  # left to the launch, which reports the SyntaxError
