"""Launch real torchrun workers from a notebook, watch them live, get their results back.

    from helpers import launch
    run = launch("helpers/workers/allreduce_demo.py", nproc=2)
    run.logs[1], run.metrics, run.results[0], run.log_dir, run.wall_time

Each launch starts one torchrun agent (PyTorch's elastic launcher, see helpers/launcher/agent.py) which
starts `nproc` workers with the usual RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
By default the agent is forked from a launch server that has already imported torch (fast);
``fresh=True`` starts fresh interpreters instead, as a terminal torchrun does. While the job runs,
every line of every rank is printed with its rank, a progress bar follows what workers report
through helpers.kit.reporting, and a failure anywhere stops everything and raises WorkerFailed with the
failing rank's traceback. A timeout, or an interrupt of the cell, first asks every live rank for
its Python stack and says where each one was stuck. Logs stay in the run folder afterwards.

Supported systems: Linux (forked workers, the default) and macOS (``fresh=True``, the default there).
The launcher uses POSIX process groups and signals: on Windows, run the lessons in WSL2.
"""
from __future__ import annotations

import os
import signal
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers.kit import REPO_ROOT
from helpers.launcher import diagnosis, run_folder
from helpers.launcher.console import Echo, Progress
from helpers.launcher.processes import Agent, LaunchServer, free_port, sleep_until_news
from helpers.launcher.run_folder import short_path
from helpers.launcher.spec import build_spec, check_arguments, new_run_dir

__all__ = ["Job", "LaunchInterrupted", "LaunchTimeout", "Run", "WorkerFailed", "alive", "free_port", "launch",
           "launch_server_pid", "start", "start_launch_server", "stop_launch_server", "wait"]

_FORK_SAFE = sys.platform.startswith("linux")
_LIBRARY_DIRS = tuple({sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")})


class _ShortTraceback:
    """IPython shows `_render_traceback_()` instead of a traceback (InteractiveShell.showtraceback): the
    message already holds what matters (the failing rank's own traceback, or where each rank was), and
    the launcher's frames tell a learner nothing. IPython never hides the innermost frame otherwise."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[31m{type(self).__name__}\x1b[0m: {self}"]


class WorkerFailed(_ShortTraceback, RuntimeError):
    """A rank failed. The message names the rank, its exit code, its traceback and the log folder; `.where` is the
    learner's own line that failed ("train.py:12 (in main)"), `.error` the exception's (or the C++ check's) line,
    `.meaning` what a C++ check from a collective means, each None when unknown."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None,
                 run: Run | None = None, where: str | None = None, error: str | None = None,
                 meaning: str | None = None):
        super().__init__(message)
        self.rank, self.exitcode, self.run = rank, exitcode, run
        self.where, self.error, self.meaning = where, error, meaning


class LaunchTimeout(WorkerFailed, TimeoutError):
    """The job ran past `timeout`; every worker was stopped. `.where[rank]` says where each rank was
    (one line), `.stacks[rank]` holds its full Python stack (also in the run folder's stacks/)."""

    def __init__(self, message: str, run: Run | None = None, where: dict[int, str] | None = None,
                 stacks: dict[int, str] | None = None) -> None:
        super().__init__(message, run=run)
        self.where, self.stacks = where or {}, stacks or {}


class LaunchInterrupted(_ShortTraceback, KeyboardInterrupt):
    """The cell was interrupted; every worker was stopped. `.where`, `.stacks`, `.run` as LaunchTimeout."""

    def __init__(self, message: str, where: dict[int, str], stacks: dict[int, str], run: Run) -> None:
        super().__init__(message)
        self.where, self.stacks, self.run = where, stacks, run


@dataclass
class Run:
    """What a finished launch hands back."""

    script: str
    nproc: int
    log_dir: Path
    logs: dict[int, str] = field(default_factory=dict)
    metrics: list[dict[str, Any]] = field(default_factory=list)
    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    wall_time: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)
    attempts: int = 1

    def metric(self, name: str, rank: int | None = None) -> list[tuple[Any, Any]]:
        """(step, value) pairs of one metric, for one rank or all ranks."""
        return [(row.get("step"), row[name]) for row in self.metrics
                if name in row and (rank is None or row["rank"] == rank)]

    def processes(self) -> set[int]:
        """The pids of every worker this run registered (any rank and attempt) and of their agents."""
        return run_folder.registered_processes(self.log_dir)

    def tracebacks(self) -> dict[int, str]:
        """Every failed rank's own traceback, as the worker recorded it (the last attempt of each rank)."""
        return run_folder.tracebacks(self.log_dir)

    def __repr__(self) -> str:
        return (f"Run({Path(self.script).name!r}, ranks={sorted(self.logs)}, "
                f"metric rows={len(self.metrics)}, log_dir={str(self.log_dir)!r})")


# ---------------------------------------------------------------------------- the kernel's launch server

def start_launch_server() -> float:
    """Start this kernel's launch server now (it starts on the first launch anyway); the seconds it took, 0.0 when it
    was already running."""
    return LaunchServer.get()[1]


def launch_server_pid() -> int | None:
    """The launch server's process id while it runs, else None."""
    return LaunchServer.instance.proc.pid if LaunchServer.running() else None


def stop_launch_server(before: str | None = None) -> int | None:
    """Stop this kernel's launch server (it exits when its input closes); its exit code, or None when none ran.
    Any launch still running under it is killed with it (server.py: every agent group dies when its input closes);
    the next launch starts a new server (a second or two).

    before: what is about to import torch afresh (a spawned or fresh interpreter). Then the cell says why the server
    was stopped: its copy of torch and the new one would add up in memory."""
    code = LaunchServer.stop()
    if code is not None and before:
        print(f"(This kernel's launch server was stopped first, so that it and {before} do not add up in memory; the "
              "next launch starts a new one.)")
    return code


def alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    return run_folder.alive(pid)


# ---------------------------------------------------------------------------- starting

def launch(script: str | os.PathLike, nproc: int = 2, args: tuple | list = (),
           timeout: float | None = None, max_restarts: int = 0, *, fresh: bool | None = None,
           log_dir: str | os.PathLike | None = None, echo: bool | int = 400, debug: bool = False,
           **torchrun_options: Any) -> Run:
    """Run `script` on `nproc` worker processes under torchrun's elastic agent; wait; return a Run.

    args: command-line arguments for the script. timeout: seconds before everything is stopped
    (LaunchTimeout, which says where each rank was stuck). max_restarts: torchrun's restarts of the
    whole group after a failure. fresh: start workers as fresh interpreters (default: fork from the
    preloaded server on Linux). echo: print each rank's lines live (True), not at all (False), or at
    most this many lines. torchrun_options: nnodes, node_rank, rdzv_endpoint, ... (TORCHRUN_OPTIONS).

    debug=True sets TORCH_DISTRIBUTED_DEBUG=DETAIL in the workers: before each collective the ranks compare
    its op, shapes and dtypes (ProcessGroupWrapper, torch/distributed/distributed_c10d.py), so a mismatch
    fails at once instead of hanging. Lesson 08 shows what it catches and what it costs.
    Raises WorkerFailed (a RuntimeError) naming the failing rank with its traceback.
    """
    __tracebackhide__ = True  # IPython shows the learner's cell and the error, not the launcher's frames
    path = check_arguments(script, nproc, timeout, max_restarts, torchrun_options)
    job = _start(path, nproc, args, max_restarts, fresh, log_dir, echo, debug, torchrun_options)
    return wait([job], timeout=timeout)[0]


def start(script: str | os.PathLike, nproc: int = 2, args: tuple | list = (), max_restarts: int = 0,
          *, fresh: bool | None = None, log_dir: str | os.PathLike | None = None,
          echo: bool | int = 400, debug: bool = False, **torchrun_options: Any) -> Job:
    """Start a launch without waiting (e.g. two "nodes" at once); finish it with wait([...])."""
    path = check_arguments(script, nproc, None, max_restarts, torchrun_options)
    return _start(path, nproc, args, max_restarts, fresh, log_dir, echo, debug, torchrun_options)


def _start(path: Path, nproc: int, args: tuple | list, max_restarts: int, fresh: bool | None,
           log_dir: str | os.PathLike | None, echo: bool | int, debug: bool, torchrun_options: dict) -> Job:
    run_dir = new_run_dir(path, log_dir)
    spec = build_spec(path, nproc, tuple(args), max_restarts, torchrun_options, run_dir, fresh_or_default(fresh),
                      debug=debug)
    return Job(spec, echo)


def fresh_or_default(fresh: bool | None) -> bool:
    """`fresh` as asked, or the platform's default: forked workers where forking is safe (Linux), else fresh."""
    return (not _FORK_SAFE) if fresh is None else fresh


# ---------------------------------------------------------------------------- a job in flight

class Job:
    """A launch in flight: its agent, and what its workers have written to the run folder so far."""

    def __init__(self, spec: dict, echo: bool | int) -> None:
        self.spec = spec
        self.run_dir = Path(spec["run_dir"])
        self.started, self.started_wall = time.perf_counter(), time.time()
        self.folder = run_folder.NodeFolder(self.run_dir, spec["node_rank"], spec["nproc"])
        self.echo = Echo(echo, run_folder.rank_log(short_path(self.run_dir), "<N>"))
        if not spec["fresh"] and not LaunchServer.running():
            self.echo.note("Starting this kernel's launch server: it imports torch once, so this first launch "
                           "takes a while longer; later launches start at once.")
        self.agent = Agent(spec)
        if self.agent.server_start:
            self.echo.note(f"Launch server ready after {self.agent.server_start:.1f} s.")

    def tick(self) -> bool:
        """Read and show new output; return True when the agent has finished."""
        done = self.agent.poll() is not None
        self.echo.show(self.folder.collect())
        return done

    def stacks(self) -> dict[int, str]:
        """Where each live rank is right now, one line per rank (full stacks: run folder, stacks/)."""
        self.tick()
        return _ask_for_stacks([self])[0]

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM the agent's group, SIGKILL whatever is left after `grace` seconds."""
        if self.agent.poll() is not None and not self.folder.live_worker_pids():
            return
        self.agent.signal_group(signal.SIGTERM)
        _wait_until(lambda: self.agent.poll() is not None, grace)
        self.agent.signal_group(signal.SIGKILL)
        for pid in self.folder.live_worker_pids().values():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _wait_until(lambda: self.agent.poll() is not None and not self.folder.live_worker_pids(), 5)

    def to_run(self) -> Run:
        folder = self.folder
        return Run(script=self.spec["script"], nproc=self.spec["nproc"], log_dir=short_path(self.run_dir),
                   logs=folder.logs_text(), metrics=folder.metrics, results=dict(folder.results),
                   wall_time=time.perf_counter() - self.started,
                   timings={"server_start": self.agent.server_start, **folder.timings(self.started_wall)},
                   attempts=folder.attempts())

    def record(self, run: Run) -> diagnosis.NodeRecord:
        folder = self.folder
        return diagnosis.NodeRecord(self.agent.code, folder.agent_outcome(), folder.failure_records(),
                                     set(folder.last_attempt()), run.logs, str(run.log_dir), folder.node)


def _wait_until(condition, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)


def _ask_for_stacks(jobs: list[Job]) -> tuple[dict[int, str], dict[int, str]]:
    """Make every live worker dump its Python stacks (faulthandler, see bootstrap.py); (where, stacks)."""
    asked = {}
    for job in jobs:
        live = job.folder.live_worker_pids()
        sizes = {rank: size for rank, size in job.folder.stack_sizes().items() if rank in live}
        for rank in sizes:
            try:
                os.kill(live[rank], run_folder.STACK_SIGNAL)
            except ProcessLookupError:
                pass
        asked[job] = sizes
    stacks: dict[int, str] = {}
    previous: dict[int, str] = {}
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:  # a dump is written at once; wait until every file stops growing
        time.sleep(0.05)
        stacks = {rank: text for job, sizes in asked.items() for rank, text in job.folder.stacks_since(sizes).items()}
        if stacks == previous and all(stacks.values()):
            break
        previous = stacks
    where = {}
    for job in jobs:
        steps = {row["rank"]: row["step"] for row in job.folder.metrics if row.get("step") is not None}
        for rank in asked[job]:
            where[rank] = diagnosis.where(stacks.get(rank, ""), job.spec["script"], _LIBRARY_DIRS, steps.get(rank))
    return where, stacks


# ---------------------------------------------------------------------------- waiting

class _Pause:
    """How long the wait loop sleeps: 20 ms while output flows, backing off to 200 ms when quiet (an
    agent's exit wakes it at once: see sleep_until_news). Measured on 2 busy cores: the kernel's share
    of one core while workers sleep fell from 2.5% (a fixed 20 ms) to 0.3%."""

    def __init__(self) -> None:
        self.seconds = 0.02

    def after(self, active: bool) -> float:
        self.seconds = 0.02 if active else min(0.2, self.seconds * 1.5)
        return self.seconds


def wait(jobs: list[Job], timeout: float | None = None) -> list[Run]:
    """Follow jobs until all finish; stop all of them on failure, timeout, interrupt or any error."""
    __tracebackhide__ = True
    deadline = None if timeout is None else time.monotonic() + timeout
    progress, pause = Progress(), _Pause()
    try:
        while True:
            before = _news(jobs)
            finished = [job.tick() for job in jobs]
            progress.draw(_bars(jobs))
            if any(job.agent.code not in (None, 0) for job in jobs) or all(finished):
                break
            if deadline is not None and time.monotonic() > deadline:
                raise _hang_error(jobs, f"timed out after {timeout:g} s: every worker was stopped "
                                  "(SIGTERM, then SIGKILL)", LaunchTimeout)
            sleep_until_news([job.agent for job in jobs], pause.after(_news(jobs) != before))
    except KeyboardInterrupt:
        raise _hang_error(jobs, "Interrupted: stopped every worker (KeyboardInterrupt)", LaunchInterrupted) from None
    finally:
        for job in jobs:  # on any exit: the rest of a failed multi-node job, stragglers, open log files
            job.stop()
            job.folder.collect(final=True)
        progress.draw(_bars(jobs), final=True)  # the bars as the run left them, also after a failure
    runs = [job.to_run() for job in jobs]
    if any(job.agent.server_lost for job in jobs):
        raise RuntimeError(f"the launch server died during the run, and its agents with it: every worker was "
                           f"stopped. Run the cell again (a new server starts). Logs: {runs[0].log_dir}/")
    if any(job.agent.code != 0 for job in jobs):
        found = diagnosis.diagnose_failure([job.record(run) for job, run in zip(jobs, runs, strict=True)],
                                            (str(Path.cwd()), str(REPO_ROOT)), _LIBRARY_DIRS)
        run = next(run for job, run in zip(jobs, runs, strict=True) if job.folder.node == found.node)
        raise WorkerFailed(found.message, rank=found.rank, exitcode=found.exitcode, run=run, where=found.where,
                           error=found.error, meaning=found.meaning)
    return runs


def _news(jobs: list[Job]) -> int:
    """How much the workers have said so far (lines and metric rows): a change means they are active."""
    return sum(len(lines) for job in jobs for lines in job.folder.lines.values()) + \
        sum(len(job.folder.metrics) for job in jobs)


def _bars(jobs: list[Job]) -> dict[int, tuple[int, int]]:
    return {rank: done_total for job in jobs for rank, done_total in job.folder.progress.items()}


def _hang_error(jobs: list[Job], headline: str, kind: type) -> BaseException:
    """Ask every live rank where it is, then stop everything; the error says where each rank was."""
    where, stacks = _ask_for_stacks(jobs)
    for job in jobs:
        job.stop(grace=1.0 if kind is LaunchInterrupted else 2.0)
        job.folder.collect(final=True)
    runs = [job.to_run() for job in jobs]
    logs = {rank: text for run in runs for rank, text in run.logs.items()}
    message = diagnosis.hang_message(headline, where, logs, str(runs[0].log_dir))
    if kind is LaunchInterrupted:
        return LaunchInterrupted(message, where, stacks, runs[0])
    return LaunchTimeout(message, runs[0], where, stacks)
