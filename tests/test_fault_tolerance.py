"""Lesson 06's checkpoints (helpers.kit.checkpoint) and the exercise's check. The crash, hang, resume and lost-node runs
of fault_tolerance_train.py are launched, and asserted, by the lesson
(notebooks/06_fault_tolerance_and_scaling_out.ipynb, under pytest --nbval); here only the failures it does not show:
a kill in the middle of a checkpoint write, a restart without a checkpoint, a global batch that does not split over
the ranks, and how the hang run's frozen rank ends (on torchrun's SIGTERM, not its SIGKILL 30 s later). What
launches nothing is tested in tests/fast/test_checkpoint_no_launch.py."""
from __future__ import annotations

import pytest
import torch

from helpers import WORKERS, WorkerFailed, free_port, launch, start, wait
from helpers.kit.checkpoint import (
    load_checkpoint,
)

TRAIN = WORKERS / "fault_tolerance_train.py"
SMALL = ["--steps", "6", "--checkpoint-every", "2", "--per-rank-batch", "16"]


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")


def reference_weights(tmp_path_factory) -> torch.Tensor:
    """Final weights of an undisturbed run: what every resumed run must reproduce."""
    run = launch(TRAIN, nproc=2, args=SMALL, echo=False, log_dir=tmp_path_factory.mktemp("reference"))
    return torch.tensor(run.results[0]["parameters"])


def test_a_kill_in_the_middle_of_a_checkpoint_write_keeps_the_previous_checkpoint(reference_weights, tmp_path):
    checkpoint = tmp_path / "ckpt.pt"
    run = launch(TRAIN, nproc=2, max_restarts=1, echo=False,
                 args=[*SMALL, "--checkpoint", checkpoint, "--fail-rank", "0", "--fail-step", "4",
                       "--fail-mode", "mid-save"])
    # rank 0 was killed (SIGKILL) inside save_checkpoint's torch.save of step 4; the restart used step 2's
    assert run.attempts == 2 and "attempt 1: world size 2, starting at step 2" in run.logs[0]
    assert torch.equal(torch.tensor(run.results[0]["parameters"]), reference_weights)
    assert load_checkpoint(checkpoint)["step"] == 6


def test_the_same_kill_with_a_save_in_place_leaves_a_checkpoint_the_restart_cannot_load(tmp_path):
    # the control: this is what makes the test above evidence for the rename, not for the kill's timing
    checkpoint = tmp_path / "ckpt.pt"
    with pytest.raises(WorkerFailed) as failure:
        launch(TRAIN, nproc=2, max_restarts=1, echo=False,
               args=[*SMALL, "--checkpoint", checkpoint, "--fail-rank", "0", "--fail-step", "4",
                     "--fail-mode", "mid-save", "--save-in-place"])
    assert failure.value.run.attempts == 2 and "load_checkpoint" in str(failure.value)
    with pytest.raises((RuntimeError, EOFError)):
        torch.load(checkpoint, weights_only=True)


def test_without_a_checkpoint_a_restart_starts_again_from_step_zero():
    run = launch(TRAIN, nproc=2, max_restarts=1, echo=False,
                 args=[*SMALL, "--fail-rank", "1", "--fail-step", "3"])
    assert "attempt 1: world size 2, starting at step 0" in run.logs[0]
    assert run.results[0]["steps"] == 6


def test_global_batch_must_split_over_the_ranks():
    with pytest.raises(WorkerFailed, match="does not split over 2 ranks"):
        launch(TRAIN, nproc=2, args=["--global-batch", "33", "--steps", "1"], echo=False)


def test_a_frozen_rank_ends_on_torchruns_sigterm_not_its_sigkill_30_s_later():
    """Walkthrough w0506, lesson 06 cell 11: when a rank fails, torchrun SIGTERMs the others and SIGKILLs them 30 s
    later, whatever --shutdown-timeout says (forked workers: ProcessContext.join in torch/multiprocessing/spawn.py;
    a script: _stop_workers -> _shutdown()). The frozen rank gives up the worker's polite-stop SIGTERM handler, so
    the SIGTERM ends it; kept, the agent logs 'Unable to shutdown process' and the cell sits 30 s longer."""
    with pytest.raises(WorkerFailed) as failure:
        launch(TRAIN, nproc=2, echo=False,
               args=[*SMALL, "--fail-rank", "1", "--fail-step", "2", "--fail-mode", "hang", "--timeout", "5"])
    assert failure.value.rank == 0 and "Timed out" in str(failure.value)
    agent_log = (failure.value.run.log_dir / "agent_node0.log").read_text()
    assert "SIGTERM" in agent_log, agent_log[-2000:]  # torchrun did send it (the log's wording depends on the path)
    assert "Unable to shutdown process" not in agent_log, agent_log[-2000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what happens without CUDA")


def test_a_worker_asked_for_nccl_fails_loudly_without_cuda():
    """No silent fall-back to gloo on the CPU when the job asked for GPUs."""
    with pytest.raises(WorkerFailed, match="backend 'nccl' needs CUDA"):
        launch(TRAIN, nproc=1, args=["--backend", "nccl", "--steps", "1"], echo=False)


def test_with_torchs_store_opt_out_a_replaced_agent_rejoins_and_the_run_is_exact(reference_weights, tmp_path,
                                                                                   monkeypatch):
    """What a Kubernetes pod replacement does: node 1's agent and worker die (SIGKILL) and a new agent takes its
    place, counting restarts from 0, while node 0's agent restarts its worker as attempt 1. A store prefix built
    from TORCHELASTIC_RESTART_COUNT would differ between the two; with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torch
    gives the new round a fresh store and the worker joins with a plain init_process_group."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")  # the agents inherit it
    # One thread per worker, as in the reference run (2 ranks on one node get OMP_NUM_THREADS=1 from the launcher;
    # an agent with one rank leaves torch's default, 2 threads here). With 2 threads MKL's matmul for fc1's weight
    # gradient sums in another order on this machine (AMD EPYC), so the weights differed in their last bits.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    port = free_port()
    common = dict(nproc=1, nnodes=2, max_restarts=1, rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                  rdzv_id="replaced", echo=False)
    timing = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=2"
    train = [*SMALL, "--checkpoint", tmp_path / "ckpt.pt"]
    host = start(TRAIN, args=train, rdzv_conf=f"is_host=1,{timing}", node_rank=0, **common)
    doomed = start(TRAIN, args=[*train, "--fail-step", "3", "--fail-mode", "node-lost"],
                   rdzv_conf=f"is_host=0,{timing}", node_rank=1, **common)
    with pytest.raises(WorkerFailed, match="-9"):
        wait([doomed], timeout=120)
    replacement = start(TRAIN, args=train, rdzv_conf=f"is_host=0,{timing}", node_rank=1, **common)
    runs = wait([host, replacement], timeout=180)
    results = [run.results[rank] for run in runs for rank in run.results]
    # the two agents count differently (the replacement starts at 0), yet they formed one group of two
    assert sorted(r["attempt"] for r in results) == [0, 1]
    assert all(r["world_size"] == 2 and r["steps"] == 6 and r["agent_store"] == "False" for r in results)
    assert torch.equal(torch.tensor(results[0]["parameters"]), reference_weights)


def test_a_sigterm_saves_the_step_and_the_resubmitted_job_loses_nothing(reference_weights, tmp_path):
    """As a terminal torchrun runs it (fresh interpreters; the lesson's run forks its workers): rank 0 sends SIGTERM
    to its agent at step 3, the agent forwards it, the ranks agree to stop after step 4 and rank 0 saves it. The
    resubmitted job starts at step 4 and ends with the undisturbed run's weights: no step lost, none redone."""
    checkpoint = tmp_path / "preempted.pt"
    with pytest.raises(WorkerFailed, match="SignalException"):  # torchrun ends with the signal it got
        launch(TRAIN, nproc=2, fresh=True, echo=False,
               args=[*SMALL, "--checkpoint", checkpoint, "--fail-rank", 0, "--fail-step", 3, "--fail-mode", "preempt"])
    assert torch.load(checkpoint, weights_only=True)["step"] == 4
    run = launch(TRAIN, nproc=2, echo=False, args=[*SMALL, "--checkpoint", checkpoint])
    assert "attempt 0: world size 2, starting at step 4" in run.logs[0]
    assert torch.equal(torch.tensor(run.results[0]["parameters"]), reference_weights)


@pytest.mark.slow
def test_torchrun_kills_a_worker_still_saving_after_its_shutdown_timeout(tmp_path):
    """Review 06-1, why the generated jobs set --shutdown-timeout (and the scheduler's window beyond it): a real
    torchrun, preempted, forwards SIGTERM and SIGKILLs a worker still running --shutdown-timeout seconds later. The
    worker takes 5 s before its save (--stop-seconds, a sleep of ours); with a 2 s timeout no checkpoint is written,
    with 20 s it is. Both torchruns run at once (fresh interpreters, as on a cluster)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "LESSONS_DATA": "digits"}
    runs = {}
    for timeout in (2, 20):
        runs[timeout] = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
             f"--shutdown-timeout={timeout}", str(TRAIN), *SMALL, "--checkpoint-every", "100",
             "--checkpoint", tmp_path / f"timeout{timeout}.pt", "--fail-rank", "0", "--fail-step", "2",
             "--fail-mode", "preempt", "--stop-seconds", "5"],
            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    logs = {timeout: run.communicate(timeout=240)[0] for timeout, run in runs.items()}
    for timeout, log in logs.items():
        assert runs[timeout].returncode != 0 and "got signal: 15" in log, log  # the job did not finish: by design
        assert "5 s of work before the save" in log, log
    assert not (tmp_path / "timeout2.pt").exists() and "stopping on SIGTERM" not in logs[2], logs[2]
    assert torch.load(tmp_path / "timeout20.pt", weights_only=True)["step"] == 3, logs[20]
    assert "step 3: stopping on SIGTERM, after saving this step" in logs[20], logs[20]
