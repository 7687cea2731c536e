"""Lesson 08's helpers without a launch."""
from __future__ import annotations

import pytest
import torch

from helpers import WORKERS
from helpers.kit.tensors import checksums
from helpers.lessons.debugging import check_mystery, run_with_progress

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
    assert not check_mystery(0, 7, "PowBackward0")
    out = capsys.readouterr().out.splitlines()
    assert all(line.startswith("Not yet: ") for line in out) and len(out) == 2
    assert "one step *after* the bad backward" in out[1]


def test_mystery_check_gives_no_hint_that_brute_forces_the_rank_or_the_step(capsys):
    # right step on the wrong rank, right rank on a too-early step, both wrong: the same words, none of them
    # saying which half is right (2 ranks would take two tries)
    for rank, step in ((0, 6), (1, 5), (0, 2)):
        assert not check_mystery(rank, step, "PowBackward0")
    out = [line.split(" is not where", 1)[1] for line in capsys.readouterr().out.splitlines()]
    assert len(set(out)) == 1 and "right" not in out[0] and "earlier" not in out[0] and "later" not in out[0], out


@pytest.mark.parametrize(("op", "message"), [
    ("SqrtBackward0", "at 0 sqrt's backward returns inf, not NaN"),  # what the code suggests, not what anomaly says
    ("MulBackward0", "'MulBackward0' is not the backward function that made the NaN: anomaly mode names it"),
])
def test_mystery_check_asks_for_the_op_anomaly_mode_names(capsys, op, message):
    assert not check_mystery(1, 6, op)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and message in out, out


def test_mystery_check_asks_for_the_fixed_copy_after_a_right_diagnosis(capsys, tmp_path):
    assert not check_mystery(1, 6, "'PowBackward0'")  # quotes and all, as anomaly mode prints it
    assert not check_mystery(1, 6, "PowBackward0", tmp_path / "my_classifier.py")
    out = capsys.readouterr().out.splitlines()
    assert "now fix the model in your copy" in out[0] and "there is no file" in out[1], out


def test_reference_losses_turn_nan_after_the_planted_step():
    from helpers.lessons.debugging import planted, reference_losses

    _, step = planted()
    losses = reference_losses()
    assert all(loss == loss for r in (0, 1) for loss in losses[r][:step])
    assert all(loss != loss for r in (0, 1) for loss in losses[r][step:])


def test_run_with_progress_speaks_while_it_waits(capsys):
    import sys

    done = run_with_progress([sys.executable, "-c", "import time; time.sleep(0.5); print('done')"], every=0.2)
    assert done.returncode == 0 and done.stdout.strip() == "done"
    assert "still running" in capsys.readouterr().out


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
