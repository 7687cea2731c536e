"""helpers.launch with real torchrun agents and workers, at the smallest size that shows each behaviour."""
from __future__ import annotations

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

from helpers import REPO_ROOT as ROOT
from helpers import LaunchTimeout, WorkerFailed, free_port, launch, start, wait
from helpers.launcher.processes import LaunchServer
from helpers.launcher.run_folder import rank_file, rank_log

WORKERS = Path(__file__).resolve().parent / "workers"
ALLREDUCE = ROOT / "helpers" / "workers" / "allreduce_demo.py"


@pytest.fixture(autouse=True)
def _runs_in_tmp(in_tmp):
    """Every test here runs in an empty folder of its own."""


def test_success_returns_logs_results_and_folder(processes):
    run = launch(ALLREDUCE, nproc=2, echo=False)
    assert sorted(run.logs) == [0, 1]
    assert "after [10.0, 12.0, 14.0, 16.0]" in run.logs[1]
    assert run.results[0]["after"] == run.results[1]["after"] == [10.0, 12.0, 14.0, 16.0]
    assert Path(rank_log(run.log_dir, 0)).is_file()
    assert "rank 1/2" in Path(rank_log(run.log_dir, 1)).read_text()
    assert 0 < run.wall_time < 60
    processes.nothing_left(run.log_dir)


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


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_failing_rank_is_named_with_its_traceback_and_nothing_is_left(processes, fresh):
    started = time.perf_counter()
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "crash_in_collective.py", nproc=2, fresh=fresh, echo=False)
    error = caught.value
    assert isinstance(error, RuntimeError)
    assert error.rank == 1 and error.exitcode == 1
    message = str(error)
    assert message.startswith("rank 1 failed first, with exit code 1")
    assert "ValueError: rank 1 broke on purpose" in message
    assert 'crash_in_collective.py", line 11' in message
    # the launcher's own frames (its bootstrap runs the script through runpy) are not the learner's traceback
    assert "helpers/launcher/" not in message and "runpy" not in message
    assert str(error.run.log_dir) in message
    # the rank's own log holds its traceback too, forked or fresh (a forked worker's went only to torch's error file)
    assert "ValueError: rank 1 broke on purpose" in error.run.logs[1]
    assert time.perf_counter() - started < 20
    processes.nothing_left(error.run.log_dir)


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


def test_fresh_interpreters_give_the_same_results(processes):
    run = launch(ALLREDUCE, nproc=2, fresh=True, echo=False)
    assert run.results[0]["after"] == [10.0, 12.0, 14.0, 16.0]
    processes.nothing_left(run.log_dir)


LAUNCHING_PROCESS = textwrap.dedent("""
    import faulthandler, signal, sys
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # _finish asks where it is if it does not end
    # as a kernel does: a process started in the background by a shell (nohup ... &) inherits SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from helpers import launch
    try:
        launch(sys.argv[1], nproc=2, echo=False, log_dir="the_run", fresh=sys.argv[2] == "fresh")
    except KeyboardInterrupt as error:  # what a kernel does with Stop: the launch's error must be one
        print(f"caught as KeyboardInterrupt: {type(error).__name__}", file=sys.stderr, flush=True)
        raise
""")


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    """The launching process's stderr once it ends; if it has not ended within `timeout`, fail with its stacks."""
    try:
        return proc.communicate(timeout=timeout)[1]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR2)
        time.sleep(1)
        proc.kill()
        stderr = proc.communicate()[1]
        pytest.fail(f"the launching process did not end within {timeout} s after SIGINT; its stderr:\n{stderr[-6000:]}")


def _start_launching_process(tmp_path: Path, processes, worker: str = "sleeper.py", ready: str = "sleeping",
                             fresh: bool = False) -> tuple[subprocess.Popen, Path]:
    """A separate Python process (standing in for a kernel) running a long launch."""
    proc = subprocess.Popen([sys.executable, "-c", LAUNCHING_PROCESS, str(WORKERS / worker),
                             "fresh" if fresh else "fork"], cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    run_dir = tmp_path / "the_run"
    deadline = time.monotonic() + 60
    while len(processes.worker_pids(run_dir)) < 2 or any(ready not in _read(rank_log(run_dir, r)) for r in (0, 1)):
        assert time.monotonic() < deadline, "workers did not start"
        time.sleep(0.1)
    return proc, run_dir


def _read(path: str | Path) -> str:
    path = Path(path)
    return path.read_text() if path.exists() else ""


def test_killed_kernel_leaves_no_worker_alive(tmp_path, processes):
    proc, run_dir = _start_launching_process(tmp_path, processes)
    pids = processes.worker_pids(run_dir)
    family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    proc.kill()
    proc.wait()
    killed = time.monotonic()
    while any(processes.alive(pid) for pid in pids + family):
        assert time.monotonic() - killed < 5, "processes outlived the killed kernel"
        time.sleep(0.05)


def test_cell_magic_runs_the_cell_as_a_worker():
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("load_ext", "helpers")
    shell.run_cell_magic("torchrun", "-n 2 --out magic_run -- 7", textwrap.dedent("""
        import os, sys
        from helpers.kit.reporting import result
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


def test_a_notebook_shows_the_message_not_the_launchers_frames():
    from IPython.testing.globalipapp import get_ipython
    from IPython.utils.capture import capture_output

    shell = get_ipython()
    with capture_output() as captured:
        shell.run_cell(f"from helpers import launch\nlaunch({str(WORKERS / 'crash_in_collective.py')!r}, echo=False)")
    shown = captured.stdout
    assert shown.splitlines()[0].endswith("rank 1 failed first, with exit code 1; no other rank is left running.")
    assert "WorkerFailed" in shown and "ValueError: rank 1 broke on purpose" in shown
    assert "helpers/launcher/" not in shown  # none of the launcher's frames (api, console, bootstrap, ...)


def test_a_rank_killed_by_a_signal_is_blamed_not_the_peer_it_broke(processes):
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "killed_in_collective.py", nproc=2, echo=False)
    assert caught.value.rank == 1
    # elastic reports the SIGKILL when its poll saw rank 1 die; otherwise the launcher says it had no error
    assert caught.value.exitcode in (-signal.SIGKILL, None)
    assert "SIGKILL" in str(caught.value) or "killed by a signal" in str(caught.value)
    processes.nothing_left(caught.value.run.log_dir)


def test_forked_workers_can_still_initialise_cuda():
    """Nothing above a forked worker (server, agent) may count CUDA devices: that poisons forks."""
    run = launch(WORKERS / "cuda_fork_state.py", nproc=2, echo=False)
    assert run.results == {rank: {"bad_fork": False, "initialized": False} for rank in (0, 1)}


# ---------------------------------------------------------------------------- hangs

HANG = WORKERS / "hang_in_collective.py"
RANK0_WHERE = "waiting in dist.all_reduce at hang_in_collective.py:20 (step 2)"
RANK1_WHERE = "in time.sleep at hang_in_collective.py:22 (step 2)"
# A timeout that starts once every rank has printed its readiness line ("hanging", "sleeping"): from that
# print to the call it hangs in is a few bytecodes, so a second is ample even on 2 loaded cores. A timeout
# counted from the start instead has to cover start-up too (10-20 s of margin, spent by every run).
SETTLE = 1.0


def _until_every_rank_says(jobs, line: str, ranks) -> None:
    """Follow `jobs` until each of `ranks` has printed `line` (a worker's sign that it reached its hang)."""
    deadline = time.monotonic() + 120
    while not set(ranks) <= {rank for job in jobs for rank, lines in job.folder.lines.items() if line in lines}:
        assert time.monotonic() < deadline, f"the workers did not all print {line!r}"
        for job in jobs:
            job.tick()
        time.sleep(0.05)


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_timeout_says_where_every_rank_hangs_and_stops_ranks_that_ignore_sigterm(processes, fresh):
    job = start(HANG, nproc=2, args=["--ignore-sigterm"], fresh=fresh, echo=False)
    _until_every_rank_says([job], "hanging", (0, 1))
    started = time.perf_counter()
    with pytest.raises(LaunchTimeout) as caught:
        wait([job], timeout=SETTLE)  # what launch(timeout=...) does after its start()
    elapsed = time.perf_counter() - started
    error = caught.value
    assert error.where == {0: RANK0_WHERE, 1: RANK1_WHERE}
    message = str(error)
    assert message.startswith(f"timed out after {SETTLE:g} s: every worker was stopped"), message[:200]
    assert f"rank 0: {RANK0_WHERE}" in message and f"rank 1: {RANK1_WHERE}" in message
    assert "[rank 1] hanging" in message  # the tail of each rank's output
    # the full stacks: the collective's own frame for rank 0, the learner's line for both
    assert "distributed_c10d.py" in error.stacks[0] and 'hang_in_collective.py", line 20' in error.stacks[0]
    assert 'hang_in_collective.py", line 22' in error.stacks[1]
    assert Path(rank_file(error.run.log_dir, "stacks", 0, 0)).read_text().strip()
    # the ranks ignore SIGTERM: stopping them takes the launcher's 2 s grace before its SIGKILL
    assert elapsed < SETTLE + 2 + 6, f"the diagnosis and the stop took {elapsed - SETTLE:.1f} s past the timeout"
    processes.nothing_left(error.run.log_dir)  # SIGKILL reached the ranks that ignored SIGTERM


def test_a_running_job_says_where_its_ranks_are(processes):
    job = start(HANG, nproc=2, echo=False)
    _until_every_rank_says([job], "hanging", (0, 1))
    assert job.stacks() == {0: RANK0_WHERE, 1: RANK1_WHERE}
    assert job.agent.poll() is None, "asking for stacks must not stop the job"
    with pytest.raises(LaunchTimeout):
        wait([job], timeout=0.1)
    processes.nothing_left(job.run_dir)


def test_a_timeout_of_two_nodes_says_where_all_four_ranks_are(processes):
    port = free_port()
    jobs = [start(HANG, nproc=2, nnodes=2, node_rank=node, rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="hang",
                  echo=False) for node in (0, 1)]
    _until_every_rank_says(jobs, "hanging", range(4))
    with pytest.raises(LaunchTimeout) as caught:
        wait(jobs, timeout=SETTLE)
    sleeping = {rank: RANK1_WHERE for rank in (1, 2, 3)}  # the worker's else branch: every rank but 0
    assert caught.value.where == {0: RANK0_WHERE, **sleeping}
    assert all(f"rank {rank}: " in str(caught.value) for rank in range(4))
    for job in jobs:
        processes.nothing_left(job.run_dir)


@pytest.mark.parametrize("fresh", [False, True], ids=["forked", "fresh"])
def test_interrupt_during_a_hang_stops_every_rank_and_says_where_it_was(tmp_path, fresh, processes):
    proc, run_dir = _start_launching_process(tmp_path, processes, "hang_in_collective.py", "hanging", fresh=fresh)
    pids = processes.worker_pids(run_dir)
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stderr = _finish(proc, 15)
    assert "caught as KeyboardInterrupt: LaunchInterrupted" in stderr  # a kernel's Stop handling sees its own kind
    assert "Interrupted: stopped every worker (KeyboardInterrupt)" in stderr
    assert f"rank 0: {RANK0_WHERE}" in stderr and f"rank 1: {RANK1_WHERE}" in stderr
    while any(processes.alive(pid) for pid in pids):
        assert time.monotonic() - interrupted < 5, "workers survived an interrupt"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- cleanup, blame, settings

SLEEPER = WORKERS / "sleeper.py"


def _started(job, processes):
    """Follow `job` until both of its workers have registered."""
    deadline = time.monotonic() + 60
    while len(processes.worker_pids(job.run_dir)) < 2:
        assert time.monotonic() < deadline, "workers did not start"
        job.tick()
        time.sleep(0.05)
    return job


def test_two_nodes_blame_the_rank_that_failed_on_the_other_node(processes):
    port = free_port()
    jobs = [start(WORKERS / "crash_in_collective.py", nproc=2, args=[3], nnodes=2, node_rank=node,
                  rdzv_endpoint=f"127.0.0.1:{port}", rdzv_id="blame", echo=False) for node in (0, 1)]
    with pytest.raises(WorkerFailed) as caught:
        wait(jobs, timeout=120)
    # node 0 comes first in the list and its ranks fail too (lost connections): rank 3 is still the cause
    assert caught.value.rank == 3 and caught.value.exitcode == 1
    assert "ValueError: rank 3 broke on purpose" in str(caught.value)
    assert 'crash_in_collective.py", line 11' in str(caught.value)
    for job in jobs:
        processes.nothing_left(job.run_dir)


def test_a_dying_launch_server_stops_everything_and_says_so(processes):
    job = _started(start(SLEEPER, nproc=2, echo=False), processes)
    LaunchServer.instance.proc.kill()
    with pytest.raises(RuntimeError, match="the launch server died during the run"):
        wait([job], timeout=30)
    assert not [pid for pid in processes.worker_pids(job.run_dir) if processes.alive(pid)]
    assert not job.folder._rank_logs, "log files were left open"


def test_an_agent_dying_without_its_result_file_is_reported(processes):
    job = _started(start(SLEEPER, nproc=2, echo=False), processes)
    os.kill(job.agent.pid, signal.SIGKILL)
    with pytest.raises(WorkerFailed, match="agent exited with code -9 and reported no failed rank"):
        wait([job], timeout=30)
    processes.nothing_left(job.run_dir)
    assert not job.folder._rank_logs, "log files were left open"


def test_workshop_cpu_budget_reaches_torch_in_forked_workers(monkeypatch):
    monkeypatch.setenv("LESSONS_CPUS", "4")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    run = launch(WORKERS / "threads.py", nproc=2, echo=False)
    assert run.results == {rank: {"omp": "2", "torch_threads": 2} for rank in (0, 1)}


def test_debug_names_mismatched_collectives():
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "mismatched_collective.py", nproc=2, debug=True, timeout=60, echo=False)
    assert "Detected mismatch between collectives on ranks" in str(caught.value)
    assert "Tensor shapes: 3vs 4" in str(caught.value) or "Tensor shapes: 4vs 3" in str(caught.value)


def test_a_collective_size_mismatch_names_the_line_and_says_what_it_means():
    """gloo aborts the receiving process from C++ (no Python traceback): faulthandler's stacks name the line."""
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "size_mismatch.py", nproc=2, echo=False, timeout=60)
    failure = caught.value
    assert failure.where == "size_mismatch.py:7 (in <module>)", str(failure)
    assert "disagree on the size" in failure.meaning and "enforce fail" in failure.error
    assert "where: size_mismatch.py:7" in str(failure)


def test_a_segfault_names_the_line_that_crashed():
    with pytest.raises(WorkerFailed) as caught:
        launch(WORKERS / "segfault.py", nproc=2, echo=False, timeout=60)
    failure = caught.value
    assert failure.rank == 1 and failure.where == "segfault.py:9 (in <module>)", str(failure)
    assert "Segmentation fault" in failure.error
