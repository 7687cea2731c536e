"""Lesson 08's library and the exercise's check. The planted bugs themselves are launched, and asserted, by
the lesson (notebooks/08_debugging.ipynb, under pytest --nbval); here only what the lesson does not check:
that the exercise's check knows the true answer and says "Not yet" to wrong ones."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import WORKERS, WorkerFailed, launch
from helpers.debugging import check_mystery
from helpers.tensors import checksums

COLLECTIVES, DDP_BUGS, MYSTERY = (WORKERS / name for name in ("debug_collectives.py", "debug_ddp.py",
                                                             "debug_mystery.py"))


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def failure(script: Path, args: list, **options) -> WorkerFailed:
    with pytest.raises(WorkerFailed) as caught:
        launch(script, nproc=2, args=args, echo=False, **options)
    return caught.value


# ------------------------------------------------------------------ helpers.debugging without launches

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
    from helpers.debugging import planted

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
