"""helpers.launch with real torchrun agents and workers, at the smallest size that shows each behaviour."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from helpers import LaunchInterrupted, LaunchTimeout, WorkerFailed, launch, start, wait
from helpers._handles import LaunchServer

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
ALLREDUCE = ROOT / "helpers" / "workers" / "allreduce_demo.py"


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def worker_pids(log_dir: Path) -> list[int]:
    return [json.loads(p.read_text())["pid"] for p in Path(log_dir).glob("workers/*.json")]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def assert_nothing_left(log_dir: Path) -> None:
    """No worker of this run and no agent under the launch server is still running."""
    pids = worker_pids(log_dir)
    assert pids, "the run registered no workers"
    assert not [pid for pid in pids if alive(pid)], "workers outlived the launch"
    server = LaunchServer.instance
    if server is not None and server.proc.poll() is None:
        left = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if p.status() != "zombie"]
        assert not left, f"processes left under the launch server: {left}"


def test_success_returns_logs_results_and_folder():
    run = launch(ALLREDUCE, nproc=2, echo=False)
    assert sorted(run.logs) == [0, 1]
    assert "after [10.0, 12.0, 14.0, 16.0]" in run.logs[1]
    assert run.results[0]["after"] == run.results[1]["after"] == [10.0, 12.0, 14.0, 16.0]
    assert {p.name for p in run.log_dir.iterdir()} >= {"rank0.log", "rank1.log"}
    assert "rank 1/2" in (run.log_dir / "rank1.log").read_text()
    assert 0 < run.wall_time < 60
    assert_nothing_left(run.log_dir)


def test_workers_get_torchrun_environment_and_metrics_round_trip():
    run = launch(WORKERS / "env_and_metrics.py", nproc=2, echo=False)
    for rank in (0, 1):
        env = run.results[rank]["env"]
        assert env["RANK"] == str(rank) and env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["MASTER_ADDR"] == "127.0.0.1" and int(env["MASTER_PORT"]) > 0
        assert env["TORCHELASTIC_RUN_ID"]
        assert run.results[rank]["square"] == rank * rank
    assert len(run.metrics) == 10
    assert run.metric("loss", rank=1) == [(s, 1.0 / (s + 2)) for s in range(5)]
    assert {row["rank"] for row in run.metrics} == {0, 1}


def test_failing_rank_is_named_with_its_traceback_and_nothing_is_left():
    started = time.perf_counter()
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "crash_in_collective.py", nproc=2, echo=False)
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert error.rank == 1 and error.exitcode == 1
    message = str(error)
    assert message.startswith("rank 1 failed first, with exit code 1")
    assert "ValueError: rank 1 broke on purpose" in message
    assert 'crash_in_collective.py", line 10' in message
    assert "_bootstrap" not in message and "runpy" not in message
    assert str(error.run.log_dir) in message
    assert time.perf_counter() - started < 20
    assert_nothing_left(error.run.log_dir)


def test_timeout_stops_everything_with_a_clear_message():
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as caught:
        launch(WORKERS / "sleeper.py", nproc=2, timeout=3, echo=False)
    assert time.perf_counter() - started < 10
    assert "timed out after 3 s" in str(caught.value)
    assert "[rank 1] sleeping" in str(caught.value)
    assert_nothing_left(caught.value.run.log_dir)


def test_worker_ignoring_sigterm_is_killed_anyway():
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as caught:
        launch(WORKERS / "sleeper.py", nproc=2, args=["--ignore-sigterm"], timeout=2, echo=False)
    assert time.perf_counter() - started < 12
    assert_nothing_left(caught.value.run.log_dir)


def test_chatty_workers_lose_and_tear_no_line():
    lines = 20_000
    run = launch(WORKERS / "chatty.py", nproc=2, args=[lines], echo=False)
    for rank in (0, 1):
        got = run.logs[rank].splitlines()
        assert len(got) == lines
        stdout_lines = [line for line in got if int(line.split("line=")[1][:6]) % 10]
        assert all(line == f"rank={rank} line={int(line[12:18]):06d} " + "x" * 60 for line in got)
        assert stdout_lines == sorted(stdout_lines), "lines of one stream came out of order"


def test_busy_default_port_does_not_matter(monkeypatch):
    with socket.socket() as blocker:
        try:
            blocker.bind(("127.0.0.1", 29500))
            blocker.listen()
        except OSError:
            pass  # something else already holds it: just as good for this test
        monkeypatch.setenv("MASTER_PORT", "29500")
        run = launch(ALLREDUCE, nproc=2, echo=False)
    assert run.results[1]["after"] == [10.0, 12.0, 14.0, 16.0]


@pytest.mark.parametrize("kwargs, error, words", [
    ({"nproc": 0}, ValueError, "nproc must be a whole number >= 1"),
    ({"script": "no_such_script.py"}, FileNotFoundError, "worker script not found: no_such_script.py"),
    ({"nprocs": 2}, TypeError, "unknown launch option(s) nprocs"),
    ({"timeout": -1}, ValueError, "timeout must be a positive"),
    ({"max_restarts": -2}, ValueError, "max_restarts must be"),
])
def test_bad_arguments_fail_at_once_before_any_process(kwargs, error, words):
    arguments = {"script": ALLREDUCE, **kwargs}
    before = set(psutil.Process().children(recursive=True))
    started = time.perf_counter()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        launch(**arguments)
    assert time.perf_counter() - started < 0.5
    assert set(psutil.Process().children(recursive=True)) <= before


def test_max_restarts_restarts_the_group_and_keeps_both_attempts_logs():
    run = launch(WORKERS / "fail_first_attempt.py", nproc=2, max_restarts=1, echo=False)
    assert run.attempts == 2
    assert "attempt 0 rank 0" in run.logs[0] and "attempt 1 rank 0" in run.logs[0]
    assert "----- restart: attempt 1 -----" in run.logs[0]
    assert len(list(run.log_dir.glob("elastic_node0/*/attempt_*"))) == 2


def test_without_restarts_the_same_failure_is_reported():
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "fail_first_attempt.py", nproc=2, echo=False)
    assert caught.value.rank == 0 and caught.value.exitcode == 3
    assert "SystemExit: 3" in str(caught.value)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU: nccl works")
def test_nccl_without_gpus_is_a_clear_worker_error():
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "nccl_on_cpu.py", nproc=2, echo=False)
    assert "nccl_on_cpu.py" in str(caught.value) and "GPU" in str(caught.value)


def test_fresh_interpreters_give_the_same_results():
    run = launch(ALLREDUCE, nproc=2, fresh=True, echo=False)
    assert run.results[0]["after"] == [10.0, 12.0, 14.0, 16.0]
    assert_nothing_left(run.log_dir)


LAUNCHING_PROCESS = textwrap.dedent("""
    import sys
    from helpers import launch
    launch(sys.argv[1], nproc=2, echo=False, log_dir="the_run", fresh=sys.argv[2] == "fresh")
""")


def _start_launching_process(tmp_path: Path, worker: str = "sleeper.py", ready: str = "sleeping",
                             fresh: bool = False) -> tuple[subprocess.Popen, Path]:
    """A separate Python process (standing in for a kernel) running a long launch."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHING_PROCESS, str(WORKERS / worker),
                             "fresh" if fresh else "fork"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "the_run"
    deadline = time.monotonic() + 60
    while len(worker_pids(run_dir)) < 2 or any(ready not in _read(run_dir / f"rank{r}.log") for r in (0, 1)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    return proc, run_dir


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def test_interrupt_stops_every_rank_within_5_seconds(tmp_path):
    proc, run_dir = _start_launching_process(tmp_path)
    pids = worker_pids(run_dir)
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=10)
    assert "KeyboardInterrupt" in stderr and "Interrupted: stopped every worker" in stderr
    while any(alive(pid) for pid in pids):
        assert time.monotonic() - interrupted < 5, "workers survived an interrupt"
        time.sleep(0.05)


def test_killed_kernel_leaves_no_worker_alive(tmp_path):
    proc, run_dir = _start_launching_process(tmp_path)
    pids = worker_pids(run_dir)
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    while any(alive(pid) for pid in pids + family):
        assert time.monotonic() - killed < 5, "processes outlived the killed kernel"
        time.sleep(0.05)


def test_cell_magic_runs_the_cell_as_a_worker():
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "helpers")
    shell.run_cell_magic("torchrun", "-n 2 --out magic_run -- 7", textwrap.dedent("""
        import os, sys
        from helpers.worker import result
        result(rank=int(os.environ["RANK"]), arg=sys.argv[1])
    """))
    run = shell.user_ns["magic_run"]
    assert run.results == {0: {"rank": 0, "arg": "7"}, 1: {"rank": 1, "arg": "7"}}
    with pytest.raises(ValueError, match="unknown option"):
        shell.run_cell_magic("torchrun", "-n 2 --bogus", "pass")


def test_worker_api_is_a_no_op_outside_the_launcher(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HELPERS_RUN_DIR"}
    env.update(RANK="0", TORCHELASTIC_RUN_ID="x")
    subprocess.run([sys.executable, str(WORKERS / "env_and_metrics.py")], cwd=tmp_path, env=env, check=True)
    assert list(tmp_path.iterdir()) == []


def test_progress_bar_follows_reported_progress():
    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    get_ipython()
    with capture_output() as captured:
        launch(WORKERS / "env_and_metrics.py", nproc=2, echo=False)
    shown = captured.outputs[-1].data["text/plain"]
    assert shown.splitlines() == [f"rank {rank} |{'█' * 30}| 5/5" for rank in (0, 1)]


def test_a_rank_killed_by_a_signal_is_blamed_not_the_peer_it_broke():
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "killed_in_collective.py", nproc=2, echo=False)
    assert caught.value.rank == 1
    # elastic reports the SIGKILL when its poll saw rank 1 die; otherwise the launcher says it had no error
    assert caught.value.exitcode in (-signal.SIGKILL, None)
    assert "SIGKILL" in str(caught.value) or "killed by a signal" in str(caught.value)
    assert_nothing_left(caught.value.run.log_dir)


def test_forked_workers_can_still_initialise_cuda():
    """Nothing above a forked worker (server, agent) may count CUDA devices: that poisons forks."""
    run = launch(WORKERS / "cuda_fork_state.py", nproc=2, echo=False)
    assert run.results == {rank: {"bad_fork": False, "initialized": False} for rank in (0, 1)}


# ---------------------------------------------------------------------------- hangs

HANG = WORKERS / "hang_in_collective.py"
RANK0_WHERE = "waiting in dist.all_reduce at hang_in_collective.py:15 (step 2)"
RANK1_WHERE = "in time.sleep at hang_in_collective.py:17 (step 2)"


def test_timeout_says_where_every_rank_hangs():
    LaunchServer.get()  # its one-time start is not part of the timeout
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as caught:
        launch(HANG, nproc=2, timeout=10, echo=False)
    elapsed = time.perf_counter() - started
    error = caught.value
    assert error.where == {0: RANK0_WHERE, 1: RANK1_WHERE}
    message = str(error)
    assert f"rank 0: {RANK0_WHERE}" in message and f"rank 1: {RANK1_WHERE}" in message
    # the full stacks: the collective's own frame for rank 0, the learner's line for both
    assert "distributed_c10d.py" in error.stacks[0] and 'hang_in_collective.py", line 15' in error.stacks[0]
    assert 'hang_in_collective.py", line 17' in error.stacks[1]
    assert (error.run.log_dir / "stacks" / "rank0-attempt0.txt").read_text().strip()
    assert elapsed < 10 + 6, f"the diagnosis took {elapsed - 10:.1f} s past the timeout"
    assert_nothing_left(error.run.log_dir)


def test_a_running_job_says_where_its_ranks_are():
    job = start(HANG, nproc=2, echo=False)
    deadline = time.monotonic() + 60
    while not all("hanging" in job.folder.lines.get(rank, []) for rank in (0, 1)):
        assert time.monotonic() < deadline, "workers did not reach the hang"
        job.tick()
        time.sleep(0.05)
    assert job.stacks() == {0: RANK0_WHERE, 1: RANK1_WHERE}
    assert job.agent.poll() is None, "asking for stacks must not stop the job"
    with pytest.raises(LaunchTimeout):
        wait([job], timeout=0.1)
    assert_nothing_left(job.run_dir)


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_interrupt_during_a_hang_says_where_every_rank_was(tmp_path, fresh):
    proc, run_dir = _start_launching_process(tmp_path, "hang_in_collective.py", "hanging", fresh=fresh)
    pids = worker_pids(run_dir)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=15)
    assert "LaunchInterrupted" in stderr and "Interrupted: stopped every worker" in stderr
    assert f"rank 0: {RANK0_WHERE}" in stderr and f"rank 1: {RANK1_WHERE}" in stderr
    assert not [pid for pid in pids if alive(pid)]
    assert issubclass(LaunchInterrupted, KeyboardInterrupt)
