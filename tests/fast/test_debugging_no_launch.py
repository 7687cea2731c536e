"""Lesson 08's helpers without a launch."""
from __future__ import annotations

import torch

from helpers import WORKERS
from helpers.kit.tensors import checksums
from helpers.lessons.debugging import check_mystery

COLLECTIVES, DDP_BUGS, MYSTERY = (WORKERS / name for name in ("debug_collectives.py", "debug_ddp.py",
                                                             "debug_mystery.py"))







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


def test_checksums_see_swapped_elements_and_equal_tensors_agree():
    a = {"w": torch.tensor([1.0, 2.0, 3.0])}
    assert checksums(a).tolist() == checksums({"w": torch.tensor([1.0, 2.0, 3.0])}).tolist()
    assert checksums(a).item() != checksums({"w": torch.tensor([2.0, 1.0, 3.0])}).item()


def test_mystery_check_says_not_yet_on_the_start_and_on_the_loss_log_guess(capsys):
    assert not check_mystery(None, None, None)
    assert not check_mystery(0, 7, None)
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith("Not yet: ") for line in out) and len(out) == 2


def test_main_thread_frames_reads_py_spy_and_faulthandler_and_stops_at_the_script():
    from helpers.lessons.debugging import main_thread_frames

    # catches frames of another thread, frames past the script's top level, or a parser for one format only
    assert main_thread_frames(PY_SPY_DUMP, "debug_collectives.py") == [
        "barrier (distributed_c10d.py:6371)", "meet (debug_collectives.py:58)", "<module> (debug_collectives.py:127)"]
    assert main_thread_frames(FAULTHANDLER_DUMP, "debug_collectives.py") == [
        "all_reduce (distributed_c10d.py:3913)", "train (debug_collectives.py:65)",
        "<module> (debug_collectives.py:127)"]


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
