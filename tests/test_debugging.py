"""Lesson 08's planted bugs, with real launches: each bug shows, the tool reports it, the fix runs."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import WORKERS, LaunchTimeout, WorkerFailed, launch
from helpers.debugging import check_mystery, last_collective, own_fingerprints, read_flight_records, repair_gloo_dump
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


# ------------------------------------------------------------------ debug_collectives.py

def test_collectives_without_a_bug_finish_and_agree():
    run = launch(COLLECTIVES, nproc=2, args=["--bug", "none"], timeout=60, echo=False)
    assert run.results == {0: {"steps": 6, "samples": 32.0}, 1: {"steps": 6, "samples": 32.0}}


def test_skipped_barrier_hangs_and_the_stacks_say_where_each_rank_waits():
    with pytest.raises(LaunchTimeout) as caught:
        launch(COLLECTIVES, nproc=2, args=["--bug", "skip-barrier"], timeout=8, echo=False)
    where = caught.value.where
    assert "dist.barrier" in where[0] and "dist.all_reduce" in where[1]


def test_monitored_barrier_names_the_rank_that_never_came():
    error = failure(COLLECTIVES, ["--bug", "skip-barrier", "--monitored", "--timeout", 4], timeout=60)
    assert error.rank == 0 and "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in str(error)


@pytest.mark.parametrize("bug, expected", [
    ("skip-barrier", {0: ("BARRIER", None), 1: ("ALLREDUCE", "Float")}),
    ("dtype", {0: ("ALLREDUCE", "Double"), 1: ("ALLREDUCE", "Long")}),
])
def test_detail_mode_reports_each_ranks_own_collective_at_once(bug, expected):
    error = failure(COLLECTIVES, ["--bug", bug], timeout=60, debug=True)
    seen = own_fingerprints(error.run)
    assert {rank: (f["op"], f["dtype"]) for rank, f in seen.items()} == expected
    assert seen[0]["sequence"] == seen[1]["sequence"] and error.run.wall_time < 30


def test_dtype_mismatch_is_silent_garbage():
    run = launch(COLLECTIVES, nproc=2, args=["--bug", "dtype"], timeout=60, echo=False)
    sixteen_bits = torch.tensor([16.0], dtype=torch.float64).view(torch.int64).item()
    assert run.results[0]["samples"] == 16.0 and run.results[1]["samples"] == sixteen_bits


def test_shape_mismatch_aborts_a_rank_with_gloos_size_check():
    error = failure(COLLECTIVES, ["--bug", "shape"], timeout=60)
    assert error.exitcode == -6 and "Received data size doesn't match expected size" in error.run.logs[error.rank]


def test_flight_recorder_dumps_show_the_mismatch_and_the_repaired_dump_feeds_the_analyser(tmp_path):
    failure(COLLECTIVES, ["--bug", "skip-barrier", "--flight-recorder", tmp_path / "fr", "--timeout", 4],
            timeout=60)
    records = read_flight_records(tmp_path / "fr")
    last = {rank: last_collective(record, "debug_collectives.py") for rank, record in records.items()}
    assert (last[0]["op"], last[1]["op"]) == ("gloo:barrier", "gloo:all_reduce")
    assert last[0]["sequence"] == last[1]["sequence"] == 7
    assert repair_gloo_dump(tmp_path / "fr", tmp_path / "repaired") == ["0"]
    analysis = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace",
                               str(tmp_path / "repaired"), "-p", "trace_"], capture_output=True, text=True)
    report = analysis.stdout + analysis.stderr  # the analyser logs its findings
    assert "Culprit rank 1" in report and "COLLECTIVE_TYPE_MISMATCH" in report


# ------------------------------------------------------------------ debug_ddp.py

def test_unused_layer_fails_with_indices_names_with_info_and_runs_with_find_unused(monkeypatch):
    error = failure(DDP_BUGS, ["--bug", "unused-layer"], timeout=60)
    assert error.rank == 0 and "did not receive grad for rank 0: 3 4" in str(error)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    named = failure(DDP_BUGS, ["--bug", "unused-layer"], timeout=60)
    assert "extra.bias, extra.weight" in str(named)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    run = launch(DDP_BUGS, nproc=2, args=["--bug", "unused-layer", "--fix"], timeout=60, echo=False)
    assert run.results[0]["steps"] == 8 and run.results[0]["checksums"] == run.results[1]["checksums"]


def test_detail_mode_crashes_ddp_construction_on_gloo():
    """torch 2.14.1: a segfault in DDP's Logger under DETAIL. If this fails, torch fixed it: update lesson 08."""
    error = failure(DDP_BUGS, ["--bug", "none"], timeout=60, debug=True)
    assert error.exitcode == -11


def test_uneven_inputs_hang_at_the_final_barrier_and_join_fixes_it():
    with pytest.raises(LaunchTimeout) as caught:
        launch(DDP_BUGS, nproc=2, args=["--bug", "uneven"], timeout=8, echo=False)
    assert "backward" in caught.value.where[0] and "dist.barrier" in caught.value.where[1]
    run = launch(DDP_BUGS, nproc=2, args=["--bug", "uneven", "--fix"], timeout=60, echo=False)
    assert (run.results[0]["steps"], run.results[1]["steps"]) == (8, 7)
    assert run.results[0]["checksums"] == run.results[1]["checksums"]


def test_parameter_outside_ddp_drifts_the_checksum_names_it_and_the_fix_keeps_replicas_equal():
    run = launch(DDP_BUGS, nproc=2, args=["--bug", "outside-ddp", "--checksum-every", 2], timeout=60, echo=False)
    assert run.results[0]["first_diverged"] == {"step": 2, "names": ["scale"]}
    assert run.results[0]["checksums"]["scale"] != run.results[1]["checksums"]["scale"]
    fixed = launch(DDP_BUGS, nproc=2, args=["--bug", "outside-ddp", "--fix", "--checksum-every", 2], timeout=60,
                   echo=False)
    assert fixed.results[0]["first_diverged"] is None
    assert fixed.results[0]["checksums"] == fixed.results[1]["checksums"]


def test_nan_on_one_rank_spreads_the_flags_and_anomaly_find_it_and_the_agreed_skip_fixes_it():
    spread = launch(DDP_BUGS, nproc=2, args=["--bug", "nan"], timeout=60, echo=False)
    first_nan = {r: next(s for s, loss in spread.metric("loss", rank=r) if loss != loss) for r in (0, 1)}
    assert first_nan == {0: 6, 1: 5}
    flagged = launch(DDP_BUGS, nproc=2, args=["--bug", "nan", "--nan-check"], timeout=60, echo=False)
    assert flagged.results[0]["first_nonfinite"] == {"step": 5, "ranks": [1]}
    anomaly = failure(DDP_BUGS, ["--bug", "nan", "--anomaly"], timeout=60)
    assert anomaly.rank == 1 and "returned nan values" in str(anomaly)
    guarded = launch(DDP_BUGS, nproc=2, args=["--bug", "nan", "--fix"], timeout=60, echo=False)
    assert guarded.results[0]["skipped"] == guarded.results[1]["skipped"] == [5]
    assert guarded.results[0]["final_loss"] == guarded.results[0]["final_loss"]  # not NaN


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
