"""What every exercise check prints when a learner's code crashes or hangs (helpers/lessons/checks.py)."""
from __future__ import annotations

from pathlib import Path

from helpers.launcher.api import LaunchTimeout, Run, WorkerFailed
from helpers.lessons.checks import explain_crash, not_yet_crashed

RUN = Run(script="zero_check.py", nproc=2, log_dir=Path("runs/RUN"))


def test_a_python_error_names_the_rank_the_line_the_error_and_the_folder():
    error = WorkerFailed("rank 1 failed first ...", rank=1, exitcode=1, run=RUN, where="my_zero.py:31 (in step)",
                         error="ValueError: shard of 3 values, expected 4")
    text = explain_crash(error, "your class")
    assert text == ("your class crashed on rank 1 at my_zero.py:31 (in step): ValueError: shard of 3 values, "
                    "expected 4. Each rank's output and traceback are in runs/RUN/rank<N>.log.")


def test_a_cpp_abort_says_what_it_means():
    error = WorkerFailed("...", rank=0, exitcode=-6, run=RUN, where="my_zero.py:40 (in step)",
                         error="enforce fail at pair.cc:464] op.preamble.length <= op.nbytes. 36 vs 35",
                         meaning="the ranks disagree on the size of a message in this collective")
    text = explain_crash(error)
    assert "rank 0 at my_zero.py:40 (in step) (exit code -6: killed by a signal, so no Python traceback)" in text
    assert "What it means: the ranks disagree on the size of a message" in text


def test_a_hang_lists_where_each_rank_waited(capsys):
    error = LaunchTimeout("timed out", run=RUN, where={1: "in time.sleep at t.py:6", 0: "waiting in dist.all_reduce"})
    assert not not_yet_crashed(error, "the check")
    out = capsys.readouterr().out
    assert out.startswith("Not yet: the check did not finish; where each rank was:\n"
                          "  rank 0: waiting in dist.all_reduce\n  rank 1: in time.sleep at t.py:6.")


def test_a_failure_of_no_rank_says_what_failed():
    text = explain_crash(WorkerFailed("the torchrun agent of node 0 itself failed:\nboom", run=RUN))
    assert text == "the check failed: the torchrun agent of node 0 itself failed. Each rank's output and traceback " \
                   "are in runs/RUN/rank<N>.log."
