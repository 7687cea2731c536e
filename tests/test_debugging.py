"""Lesson 08's library and the exercise's check. The planted bugs themselves are launched, and asserted, by
the lesson (notebooks/08_debugging.ipynb, under pytest --nbval); here only what the lesson does not check:
that the exercise's check knows the true answer and says "Not yet" to wrong ones."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import WORKERS, WorkerFailed, launch
from helpers.kit.tensors import checksums
from helpers.lessons.debugging import check_mystery

COLLECTIVES, DDP_BUGS, MYSTERY = (WORKERS / name for name in ("debug_collectives.py", "debug_ddp.py",
                                                             "debug_mystery.py"))


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def failure(script: Path, args: list, **options) -> WorkerFailed:
    with pytest.raises(WorkerFailed) as caught:
        launch(script, nproc=2, args=args, echo=False, **options)
    return caught.value


# ------------------------------------------------------------------ helpers.lessons.debugging without launches

def test_checksums_see_swapped_elements_and_equal_tensors_agree():
    a = {"w": torch.tensor([1.0, 2.0, 3.0])}
    assert checksums(a).tolist() == checksums({"w": torch.tensor([1.0, 2.0, 3.0])}).tolist()
    assert checksums(a).item() != checksums({"w": torch.tensor([2.0, 1.0, 3.0])}).item()


def test_mystery_check_says_not_yet_on_the_start_and_on_the_loss_log_guess(capsys):
    assert not check_mystery(None, None, None)
    assert not check_mystery(0, 7, None)
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith("Not yet: ") for line in out) and len(out) == 2


# ------------------------------------------------------------------ debug_mystery.py

def test_mystery_nan_flag_names_every_rank_anomaly_names_the_planted_one_and_eps_fixes_it():
    from helpers.lessons.debugging import planted

    rank, step = planted()
    flagged = launch(MYSTERY, nproc=2, args=["--nan-check"], timeout=60, echo=False)
    assert flagged.results[0]["first_nonfinite"] == {"step": step + 1, "ranks": [0, 1]}
    anomaly = failure(MYSTERY, ["--anomaly"], timeout=60)
    last_step = int(re.findall(r"^step (\d+): loss", anomaly.run.logs[anomaly.rank], re.M)[-1])
    assert (anomaly.rank, last_step) == (rank, step)
    unfixed = launch(MYSTERY, nproc=2, timeout=60, echo=False)
    assert not check_mystery(rank, step, unfixed)
    fixed = launch(MYSTERY, nproc=2, args=["--eps", "1e-8"], timeout=60, echo=False)
    assert check_mystery(rank, step, fixed)


def test_mystery_check_says_a_lower_learning_rate_is_no_fix(capsys):
    # A learner who guesses the NaN is a step too large: sqrt(0)'s infinite slope does not care about the step size
    from helpers.lessons.debugging import planted

    rank, step = planted()
    slower = launch(MYSTERY, nproc=2, args=["--lr", "0.01"], timeout=60, echo=False)
    assert not check_mystery(rank, step, slower)
    assert "final losses are not finite" in capsys.readouterr().out


# ------------------------------------------------------------------ lesson 08's Flight Recorder and live-hang tools

def test_flight_recorder_records_by_default_and_zero_turns_it_off(monkeypatch, tmp_path):
    from helpers.lessons.debugging import read_flight_records

    launch(COLLECTIVES, nproc=2, args=["--bug", "none", "--flight-recorder", tmp_path / "default"], timeout=60,
           echo=False)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    launch(COLLECTIVES, nproc=2, args=["--bug", "none", "--flight-recorder", tmp_path / "off"], timeout=60,
           echo=False)
    default, off = read_flight_records(tmp_path / "default"), read_flight_records(tmp_path / "off")
    # 6 steps of 2 all-reduces and 2 barriers: a recorder that is off by default records none
    assert {rank: len(r["entries"]) for rank, r in default.items()} == {0: 14, 1: 14}
    assert {rank: len(r["entries"]) for rank, r in off.items()} == {0: 0, 1: 0}


PY_SPY_DUMP = """Process 12: python -m helpers.launcher.server
Python v3.11.7 (/usr/bin/python3.11)

Thread 12 (idle): "MainThread"
    barrier (torch/distributed/distributed_c10d.py:6371)
    meet (helpers/workers/debug_collectives.py:58)
    <module> (helpers/workers/debug_collectives.py:127)
    run_script (helpers/launcher/bootstrap.py:93)
Thread 13 (idle): "Thread-1 (loop)"
    loop (helpers/workers/debug_collectives.py:90)
"""

FAULTHANDLER_DUMP = """step 3: gradient[0] 3, samples 32
Thread 0x00007f0000000001 (most recent call first):
  File "/x/helpers/workers/debug_collectives.py", line 90 in loop

Current thread 0x00007f3138e18b80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/x/helpers/workers/debug_collectives.py", line 65 in train
  File "/x/helpers/workers/debug_collectives.py", line 127 in <module>
  File "/x/helpers/launcher/bootstrap.py", line 93 in run_script
"""


def test_main_thread_frames_reads_py_spy_and_faulthandler_and_stops_at_the_script():
    from helpers.lessons.debugging import main_thread_frames

    # catches frames of another thread, frames past the script's top level, or a parser for one format only
    assert main_thread_frames(PY_SPY_DUMP, "debug_collectives.py") == [
        "barrier (distributed_c10d.py:6371)", "meet (debug_collectives.py:58)", "<module> (debug_collectives.py:127)"]
    assert main_thread_frames(FAULTHANDLER_DUMP, "debug_collectives.py") == [
        "all_reduce (distributed_c10d.py:3913)", "train (debug_collectives.py:65)",
        "<module> (debug_collectives.py:127)"]


WATCHDOG_LOG = """step 3: gradient[0] 3, samples 32
Timeout (0:00:02)!
Thread 0x00007f0000000001 (most recent call first):
  File "/x/helpers/workers/debug_collectives.py", line 90 in loop

Thread 0x00007f3138e18b80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 6371 in barrier
  File "/x/helpers/workers/debug_collectives.py", line 68 in meet
  File "/x/helpers/workers/debug_collectives.py", line 189 in <module>
  File "/x/helpers/launcher/bootstrap.py", line 96 in run_script
Timeout (0:00:02)!
Thread 0x00007f3138e18b80 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 6371 in barrier
  File "/x/helpers/workers/debug_collectives.py", line 189 in <module>
RuntimeError: the collective timed out
"""


def test_watchdog_dumps_reads_every_dump_of_the_thread_that_runs_the_script():
    from helpers.lessons.debugging import watchdog_dumps

    # a reader that took the first thread (a helper thread), or ran past the script's top level, would fail here
    assert watchdog_dumps(WATCHDOG_LOG, "debug_collectives.py") == [
        ["barrier (distributed_c10d.py:6371)", "meet (debug_collectives.py:68)", "<module> (debug_collectives.py:189)"],
        ["barrier (distributed_c10d.py:6371)", "<module> (debug_collectives.py:189)"]]
    assert watchdog_dumps("step 1: no dump here\n", "debug_collectives.py") == []


def test_watchdog_leaves_each_hung_ranks_stack_without_a_signal():
    from helpers.lessons.debugging import watchdog_dumps

    error = failure(COLLECTIVES, ["--bug", "skip-barrier", "--watchdog", 1, "--timeout", 4], timeout=60)
    dumps = {rank: watchdog_dumps(error.run.logs[rank], "debug_collectives.py") for rank in (0, 1)}
    assert dumps[0] and dumps[0][0][0].startswith("barrier (") and dumps[1][0][0].startswith("all_reduce (")
    # re-armed every step: the steps before the hang (a few ms each) leave no dump
    fine = launch(COLLECTIVES, nproc=2, args=["--bug", "none", "--watchdog", 1], timeout=60, echo=False)
    assert not any(watchdog_dumps(log, "debug_collectives.py") for log in fine.logs.values())


def test_network_check_gets_the_known_sum_on_every_rank_and_runs_alone():
    checked = launch(WORKERS / "debug_network_check.py", nproc=2, args=["--megabytes", 1], timeout=60, echo=False)
    assert all(checked.results[rank]["sum_ok"] and checked.results[rank]["busbw"] > 0 for rank in (0, 1))
    alone = launch(WORKERS / "debug_network_check.py", nproc=1, args=["--megabytes", 1], timeout=60, echo=False)
    assert alone.results[0]["sum_ok"]


def test_detail_cost_wraps_only_the_group_created_under_detail():
    # Our worker's design: the comparison means something only if exactly one of the two groups is checked
    run = launch(WORKERS / "debug_detail_cost.py", nproc=2, args=["--calls", 2, "--rounds", 5], timeout=60,
                 echo=False)
    assert (run.results[0]["plain"], run.results[0]["wrapped"]) == ("ProcessGroupGloo", "_ProcessGroupWrapper")
    assert all(len(run.results[0]["timings"][name]["wall"]) == 5 for name in ("plain", "DETAIL"))


def test_torchrun_summary_keeps_the_ranks_and_masks_what_changes_every_run():
    from helpers.lessons.debugging import torchrun_summary

    output = ("noise\ntorch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n" + "=" * 60 + "\n"
              "x.py FAILED\n" + "-" * 60 + "\nFailures:\n  <NO_OTHER_FAILURES>\n" + "-" * 60 + "\n"
              "Root Cause (first observed failure):\n[0]:\n  time      : 2026-12-03_19:45:24\n"
              "  host      : node17\n  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 4162)\n"
              "  error_file: <N/A>\n  traceback : Signal 6 (SIGABRT) received by PID 4162\n" + "=" * 60 +
              "\nlater lines\n")
    summary = torchrun_summary(output)
    assert summary.startswith("torch.distributed") and summary.endswith("=" * 60) and "later" not in summary
    assert "rank      : 1 (local_rank: 1)" in summary and "exitcode  : -6" in summary
    assert not any(word in summary for word in ("node17", "4162", "19:45"))


def test_stacks_on_signal_prints_the_hung_rank_stack_to_its_log():
    import os
    import signal
    import time

    from helpers import start
    from helpers.lessons.debugging import main_thread_frames, wait_until_step, worker_pids

    job = start(COLLECTIVES, nproc=2, args=["--bug", "skip-barrier", "--stacks-on-signal"], echo=False)
    try:
        wait_until_step(job, 3)
        os.kill(worker_pids(job)[1], signal.SIGUSR1)
        time.sleep(0.5)
    finally:
        job.stop()
        job.folder.collect(final=True)
    log = job.to_run().logs[1]
    frames = main_thread_frames(log[log.index("Current thread"):], "debug_collectives.py")
    assert frames[0].startswith("all_reduce (") and frames[-1].startswith("<module> (debug_collectives.py")


def test_the_during_the_hang_dump_is_chosen_by_the_clock(tmp_path, monkeypatch):
    # Our worker's mechanism, not torch's: on an error, rank<N> must hold the last background dump taken at least
    # `margin` seconds before the error was caught, not the newest one (which can show the failure: C++ retires the
    # collective before Python raises). Catches a worker that leaves the newest dump in place.
    import importlib.util
    import time

    spec = importlib.util.spec_from_file_location("debug_collectives", COLLECTIVES)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    monkeypatch.setattr(worker, "flight_record", lambda: repr(time.monotonic()).encode())  # each dump: its time
    dumping = worker.KeepDumping(str(tmp_path), rank=0, seconds=0.02, margin=0.3)
    time.sleep(0.6)
    failed_at = time.monotonic()
    time.sleep(0.1)  # dumps go on after the failure, until the error is caught
    newest = float((tmp_path / "rank0").read_bytes())
    dumping.stop_before(failed_at=failed_at)
    kept = float((tmp_path / "rank0").read_bytes())
    assert newest > failed_at - 0.3  # the newest dump was too late: what the choice must undo
    assert failed_at - 0.3 - 0.25 < kept <= failed_at - 0.3  # and it is one of the last before that point
