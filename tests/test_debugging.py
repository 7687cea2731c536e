"""Lesson 08's library and the exercise's check. The planted bugs themselves are launched, and asserted, by the lesson
(notebooks/08_debugging.ipynb, under pytest --nbval); here only what the lesson does not check: that the exercise's
check knows the true answer and says "Not yet" to wrong ones. What launches nothing is tested in
tests/fast/test_debugging_no_launch.py."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from helpers import WORKERS, WorkerFailed, launch
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


# ------------------------------------------------------------------ debug_mystery.py


ORIGINAL = """import torch
from torch import nn


class Classifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layer = nn.Linear(16, 8, bias=False), nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        length = torch.sqrt((h ** 2).sum(1, keepdim=True))
        return self.layer(torch.cat([h, length], dim=1))
"""
LENGTH = "length = torch.sqrt((h ** 2).sum(1, keepdim=True))"


def learner_copy(tmp_path: Path, name: str, length: str) -> Path:
    """The exercise's starting copy of the model, with its length line replaced by a learner's."""
    path = tmp_path / f"{name}.py"
    path.write_text(ORIGINAL.replace(LENGTH, length))
    return path


def test_mystery_nan_flag_names_every_rank_anomaly_names_the_planted_one_and_its_op():
    from helpers.lessons.debugging import MYSTERY_OP, planted, reference_losses

    rank, step = planted()
    flagged = launch(MYSTERY, nproc=2, args=["--nan-check"], timeout=60, echo=False)
    assert flagged.results[0]["first_nonfinite"] == {"step": step + 1, "ranks": [0, 1]}
    anomaly = failure(MYSTERY, ["--anomaly"], timeout=60)
    last_step = int(re.findall(r"^step (\d+): loss", anomaly.run.logs[anomaly.rank], re.M)[-1])
    assert (anomaly.rank, last_step) == (rank, step)
    assert re.search(r"Function '(\w+)' returned nan values", str(anomaly))[1] == MYSTERY_OP
    # the check's in-process reference is the job: the same losses wherever they are finite
    unfixed = launch(MYSTERY, nproc=2, timeout=60, echo=False)
    reference = reference_losses()
    for r in (0, 1):
        assert unfixed.results[r]["losses"][:step] == pytest.approx(reference[r][:step], abs=1e-6)
        assert all(loss != loss for loss in reference[r][step:])  # NaN after the planted step, as in the job


def test_a_lower_learning_rate_is_no_fix():
    # A learner who guesses the NaN is a step too large: sqrt(0)'s infinite slope does not care about the step size
    slower = launch(MYSTERY, nproc=2, args=["--lr", "0.01"], timeout=60, echo=False)
    assert all(values["final_loss"] != values["final_loss"] for values in slower.results.values())


@pytest.mark.parametrize(("length", "message"), [
    (LENGTH, "its final losses are not finite"),  # the untouched copy
    ("length = torch.where((h ** 2).sum(1, keepdim=True) > 0, torch.sqrt((h ** 2).sum(1, keepdim=True)), 0.0)",
     "its final losses are not finite"),  # where() still runs sqrt's backward at 0: 0 * inf
    ("length = torch.sqrt((h ** 2).sum(1, keepdim=True)).detach()",
     "with your model the loss of step 2 on rank 0"),  # no NaN, but the embedding no longer learns from the length
    ("length = torch.sqrt((h ** 2).sum(1, keepdim=True) + 1.0)",
     "with your model the loss of step 1 on rank 0"),  # an epsilon so large it changes every length
    ("length = torch.sqrt((h ** 2).sum(1, keepdim=True)) + undefined_name",
     "crashed on rank N at crashes.py:12 (in forward): NameError"),
])
def test_mystery_check_names_a_wrong_fix(tmp_path, capsys, length, message):

    name = "crashes" if "undefined" in length else "fix"
    assert not check_mystery(1, 6, "PowBackward0", learner_copy(tmp_path, name, length))
    out = re.sub(r"(?<=crashed on rank )\d", "N", capsys.readouterr().out.splitlines()[-1])
    assert out.startswith("Not yet: ") and message in out, out


@pytest.mark.parametrize("length", [
    "length = torch.sqrt((h ** 2).sum(1, keepdim=True) + 1e-8)",
    "length = torch.linalg.vector_norm(h, dim=1, keepdim=True)",  # its backward gives 0 at a zero vector
    "length = torch.sqrt((h ** 2).sum(1, keepdim=True).clamp(min=1e-12))",
])
def test_mystery_check_accepts_fixes_built_differently(tmp_path, capsys, length):

    assert check_mystery(1, 6, "PowBackward0", learner_copy(tmp_path, "fix", length))
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct: ")


def test_mystery_check_passes_the_solution_file(capsys):

    assert check_mystery(1, 6, "PowBackward0", WORKERS / "debug_mystery_solution.py")


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
