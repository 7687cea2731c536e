"""Launch real torchrun workers from a notebook, watch them live, get their results back.

    from helpers import launch
    run = launch("helpers/workers/allreduce_demo.py", nproc=2)
    run.logs[1], run.metrics, run.results[0], run.log_dir, run.wall_time

Each launch starts one torchrun agent (PyTorch's elastic launcher, see helpers/_agent.py) which
starts `nproc` workers with the usual RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT.
By default the agent is forked from a launch server that has already imported torch (fast);
``fresh=True`` starts fresh interpreters instead, as a terminal torchrun does. While the job runs,
every line of every rank is printed with its rank, a progress bar follows what workers report
through helpers.worker, and a failure anywhere stops everything and raises WorkerFailed with the
failing rank's traceback. Logs stay in the run folder afterwards.
"""
from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from helpers._display import REPO_ROOT, LiveView, short_path

# Python-side names of the torchrun options that pass through (see `torchrun --help`).
TORCHRUN_OPTIONS = {
    "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "master_addr", "master_port", "local_addr", "role", "start_method", "monitor_interval",
}
_FORK_SAFE = sys.platform.startswith("linux")


class WorkerFailed(RuntimeError):
    """A rank failed. The message names the rank, its exit code, its traceback and the log folder."""

    def __init__(self, message: str, rank: int | None = None, exitcode: int | None = None,
                 run: Run | None = None):
        super().__init__(message)
        self.rank, self.exitcode, self.run = rank, exitcode, run


class LaunchTimeout(WorkerFailed, TimeoutError):
    """The job ran past `timeout`; every worker was stopped."""


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

    def __repr__(self) -> str:
        return (f"Run({Path(self.script).name!r}, ranks={sorted(self.logs)}, "
                f"metric rows={len(self.metrics)}, log_dir={str(self.log_dir)!r})")


# ---------------------------------------------------------------------------- launch server

class _LaunchServer:
    """The kernel's handle on helpers/_server.py (started once, on first use)."""

    instance: _LaunchServer | None = None

    def __init__(self) -> None:
        started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers._server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True, env=_child_env())
        self.buffer = b""
        self.exit_codes: dict[int, int] = {}
        self._read_until("ready", timeout=120)
        self.start_time = time.perf_counter() - started

    @classmethod
    def get(cls) -> tuple[_LaunchServer, float]:
        """The running server and how long this call spent starting it (0 when already up)."""
        if cls.instance is None or cls.instance.proc.poll() is not None:
            cls.instance = cls()
            return cls.instance, cls.instance.start_time
        return cls.instance, 0.0

    def _messages(self, timeout: float) -> list[dict]:
        fd = self.proc.stdout.fileno()
        if select.select([fd], [], [], timeout)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the launch server exited unexpectedly; run the cell again")
            self.buffer += chunk
        lines = self.buffer.split(b"\n")
        self.buffer = lines.pop()
        messages = [json.loads(line) for line in lines if line.strip()]
        for message in messages:
            if "exited" in message:
                self.exit_codes[message["exited"]] = message["code"]
        return messages

    def _read_until(self, key: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self._messages(0.1):
                if key in message:
                    return message
        raise RuntimeError(f"the launch server did not answer '{key}' within {timeout:.0f} s")

    def start(self, spec: dict) -> int:
        self.proc.stdin.write((json.dumps({"spec": spec}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_until("started", timeout=30)["started"]

    def poll(self, pid: int) -> int | None:
        self._messages(0)
        return self.exit_codes.pop(pid, None)


def free_port() -> int:
    """A TCP port on loopback that is free right now (for an explicit rdzv_endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


class _Agent:
    """One torchrun agent process (a process-group leader), forked by the server or fresh."""

    def __init__(self, spec: dict) -> None:
        if spec["fresh"]:
            spec_path = Path(spec["run_dir"]) / f"spec_node{spec['node_rank']}.json"
            spec_path.write_text(json.dumps(spec))
            with open(Path(spec["run_dir"]) / f"agent_node{spec['node_rank']}.log", "ab") as log:
                self.popen = subprocess.Popen([sys.executable, "-m", "helpers._agent", str(spec_path)],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                              start_new_session=True, env=spec["env"], cwd=spec["cwd"])
            self.pid, self.server, self.server_start = self.popen.pid, None, 0.0
        else:
            self.popen = None
            self.server, self.server_start = _LaunchServer.get()
            self.pid = self.server.start(spec)
        self.code: int | None = None

    def poll(self) -> int | None:
        if self.code is None:
            self.code = self.popen.poll() if self.popen else self.server.poll(self.pid)
        return self.code

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


# ---------------------------------------------------------------------------- the launch

def _check_arguments(script: str | os.PathLike, nproc: int, timeout: float | None,
                     max_restarts: int, options: dict) -> Path:
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a whole number >= 1 (processes per node), got {nproc!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}")
    unknown = sorted(set(options) - TORCHRUN_OPTIONS)
    if unknown:
        raise TypeError(f"unknown launch option(s) {', '.join(unknown)}; torchrun options that pass "
                        f"through are: {', '.join(sorted(TORCHRUN_OPTIONS))}")
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"worker script not found: {script} (looked in {short_path(Path.cwd())})")
    return path.resolve()


def _new_run_dir(script: Path, log_dir: str | os.PathLike | None) -> Path:
    if log_dir is not None:
        folder = Path(log_dir)
    else:
        base = Path(os.environ.get("HELPERS_RUNS_DIR", "runs"))
        folder = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-{uuid.uuid4().hex[:4]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _torchrun_argv(options: dict) -> list[str]:
    options = dict(options)
    if "rdzv_endpoint" not in options and options.get("rdzv_backend", "c10d") == "c10d":
        # like --standalone, but on loopback: port 0 lets the OS pick a free port
        options.setdefault("rdzv_backend", "c10d")
        options["rdzv_endpoint"] = "127.0.0.1:0"
        options.setdefault("rdzv_id", uuid.uuid4().hex)
    options.setdefault("local_addr", "127.0.0.1")
    return [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]


def build_spec(script: Path, nproc: int, args: tuple, max_restarts: int, options: dict,
               run_dir: Path, fresh: bool, stop_grace: int = 2) -> dict:
    """Everything an agent needs, as plain JSON (it may travel to a fresh interpreter)."""
    env = _child_env()
    env["HELPERS_RUN_DIR"] = str(run_dir.resolve())
    env["HELPERS_NODE"] = str(int(options.get("node_rank", 0)))
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does: no oversubscription
    node_rank = int(options.get("node_rank", 0))
    return {"script": str(script), "args": [str(a) for a in args], "nproc": nproc,
            "max_restarts": max_restarts, "torchrun_argv": _torchrun_argv(options),
            "run_dir": str(run_dir.resolve()), "node_rank": node_rank,
            "elastic_log_dir": str((run_dir / f"elastic_node{node_rank}").resolve()),
            "fresh": fresh, "stop_grace": stop_grace, "monitor_interval": 0.05,
            "env": env, "cwd": os.getcwd()}


def launch(script: str | os.PathLike, nproc: int = 2, args: tuple | list = (),
           timeout: float | None = None, max_restarts: int = 0, *, fresh: bool | None = None,
           log_dir: str | os.PathLike | None = None, echo: bool | int = 400,
           **torchrun_options: Any) -> Run:
    """Run `script` on `nproc` worker processes under torchrun's elastic agent; wait; return a Run.

    args: command-line arguments for the script. timeout: seconds before everything is stopped
    (LaunchTimeout). max_restarts: torchrun's restarts of the whole group after a failure.
    fresh: start workers as fresh interpreters (default: fork from the preloaded server on Linux).
    echo: print each rank's lines live (True), not at all (False), or at most this many lines.
    torchrun_options: nnodes, node_rank, rdzv_endpoint, ... (see TORCHRUN_OPTIONS).
    Raises WorkerFailed (a RuntimeError) naming the failing rank with its traceback.
    """
    __tracebackhide__ = True  # IPython shows the learner's cell and the error, not the launcher's frames
    _check_arguments(script, nproc, timeout, max_restarts, torchrun_options)
    job = start(script, nproc, args, max_restarts, fresh=fresh, log_dir=log_dir, echo=echo,
                **torchrun_options)
    return wait([job], timeout=timeout)[0]


def start(script: str | os.PathLike, nproc: int = 2, args: tuple | list = (), max_restarts: int = 0,
          *, fresh: bool | None = None, log_dir: str | os.PathLike | None = None,
          echo: bool | int = 400, **torchrun_options: Any) -> Job:
    """Start a launch without waiting (e.g. two "nodes" at once); finish it with wait([...])."""
    path = _check_arguments(script, nproc, None, max_restarts, torchrun_options)
    fresh = (not _FORK_SAFE) if fresh is None else fresh
    run_dir = _new_run_dir(path, log_dir)
    spec = build_spec(path, nproc, tuple(args), max_restarts, torchrun_options, run_dir, fresh)
    return Job(spec, echo)


class Job:
    """A launch in flight: its agent, and the live view that tails the run folder."""

    def __init__(self, spec: dict, echo: bool | int) -> None:
        self.spec = spec
        self.run_dir = Path(spec["run_dir"])
        self.node_rank = spec["node_rank"]
        self.started, self.started_wall = time.perf_counter(), time.time()
        self.agent = _Agent(spec)
        self.view = LiveView(self.run_dir, spec["node_rank"], spec["nproc"], echo)

    def tick(self) -> bool:
        """Read new output; return True when the agent has finished."""
        done = self.agent.poll() is not None
        self.view.collect()
        return done

    def stop(self, grace: float = 2.0) -> None:
        """SIGTERM the agent's group, SIGKILL whatever is left after `grace` seconds."""
        if self.agent.poll() is not None and not self.view.live_worker_pids():
            return
        self.agent.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self.agent.poll() is None:
            time.sleep(0.02)
        self.agent.signal_group(signal.SIGKILL)
        for pid in self.view.live_worker_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (self.agent.poll() is None or self.view.live_worker_pids()):
            time.sleep(0.02)

    def to_run(self) -> Run:
        view = self.view
        view.collect(final=True)
        return Run(script=self.spec["script"], nproc=self.spec["nproc"], log_dir=short_path(self.run_dir),
                   logs=view.logs_text(), metrics=view.metrics, results=dict(view.results),
                   wall_time=time.perf_counter() - self.started,
                   timings={"server_start": self.agent.server_start, **view.timings(self.started_wall)},
                   attempts=view.attempts())


def wait(jobs: list[Job], timeout: float | None = None) -> list[Run]:
    """Follow jobs until all finish; stop all of them on failure, timeout or interrupt."""
    __tracebackhide__ = True
    deadline = None if timeout is None else time.monotonic() + timeout
    LiveView.reset_progress()
    try:
        while True:
            finished = [job.tick() for job in jobs]
            LiveView.refresh_progress([job.view for job in jobs])
            if any(job.agent.code not in (None, 0) for job in jobs) or all(finished):
                break
            if deadline is not None and time.monotonic() > deadline:
                for job in jobs:
                    job.stop()
                raise _timeout_error(jobs, timeout)
            time.sleep(0.02)
    except KeyboardInterrupt:
        for job in jobs:
            job.stop(grace=1.0)
        print(f"Interrupted: stopped every worker. Logs: {short_path(jobs[0].run_dir)}", file=sys.stderr)
        raise
    for job in jobs:
        job.stop()  # the rest of a failed multi-node job, and any straggler process
        job.tick()
    LiveView.refresh_progress([job.view for job in jobs], final=True)
    runs = [job.to_run() for job in jobs]
    for job, run in zip(jobs, runs, strict=True):
        if job.agent.code != 0:
            raise _failure_error(job, run)
    return runs


def _timeout_error(jobs: list[Job], timeout: float) -> LaunchTimeout:
    job = jobs[0]
    run = job.to_run()
    tails = "\n".join(f"  [rank {rank}] {text.splitlines()[-1] if text.strip() else '(no output)'}"
                      for rank, text in sorted(run.logs.items()))
    return LaunchTimeout(f"timed out after {timeout:g} s: every worker was stopped (SIGTERM, then "
                         f"SIGKILL). Last line of each rank:\n{tails}\nLogs: {run.log_dir}/", run=run)


def _failure_error(job: Job, run: Run) -> WorkerFailed:
    result_path = job.run_dir / f"agent_result_node{job.node_rank}.json"
    outcome = json.loads(result_path.read_text()) if result_path.exists() else {}
    if "agent_error" in outcome:
        return WorkerFailed(f"the torchrun agent itself failed:\n{_clean_traceback(outcome['agent_error'])}"
                            f"\nLogs: {run.log_dir}/", run=run)
    failures = {int(rank): info for rank, info in outcome.get("failures", {}).items()}
    tracebacks = job.view.failure_records()
    if not failures and not tracebacks:
        return WorkerFailed(f"the torchrun agent exited with code {job.agent.code} and reported no "
                            f"failed rank; see {run.log_dir}/agent_node{job.node_rank}.log", run=run)
    rank = _root_cause(failures, tracebacks, job.view.ranks_of_last_attempt())
    if rank in failures:
        info = failures[rank]
        code = info["exitcode"]
        how = f"exit code {code}" + (f" ({info['signal']})" if info.get("signal") else "")
    elif rank in tracebacks:
        code, how = 1, "exit code 1"  # an uncaught Python exception exits with 1
    else:
        code, how = None, "no Python error (killed by a signal, or it left while its peers still waited)"
    record = tracebacks.get(rank)
    body = _clean_traceback(record["traceback"]) if record else _last_lines(run.logs.get(rank, ""))
    title = "traceback" if record else "last lines of output"
    return WorkerFailed(f"rank {rank} failed first, with {how}; every other rank was stopped.\n"
                        f"--- {title} from rank {rank} ---\n{body.rstrip()}\n"
                        f"--- logs of every rank: {run.log_dir}/ ---", rank=rank, exitcode=code, run=run)


# What a rank says when a *peer* died: a symptom, never the root cause. A timeout is not in the list:
# a rank that hangs never errors, so the rank whose collective timed out is the one to report.
_PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")


def _root_cause(failures: dict[int, dict], tracebacks: dict[int, dict], ranks: set[int]) -> int:
    """The rank that failed first, from the best evidence available, in this order:

    1. the earliest exception that is not a peer-connection symptom (the bootstrap records exact times;
       elastic's own summary lists only the ranks it saw at one poll, with whole-second timestamps);
    2. a rank killed by a signal we did not send (SIGKILL by the OOM killer, SIGSEGV, ...): it leaves
       no traceback, and the ranks it broke only report lost connections;
    3. when every traceback is such a symptom, a rank that left without one (killed, or exited early);
    4. the earliest exception of any kind; 5. elastic's order, SIGTERMed ranks last.
    """
    genuine = [r for r in tracebacks if not any(s in tracebacks[r]["traceback"] for s in _PEER_SYMPTOMS)]
    if genuine:
        return min(genuine, key=lambda r: tracebacks[r]["time"])
    signalled = [r for r in failures if r not in tracebacks and failures[r]["exitcode"] < 0
                 and failures[r]["exitcode"] != -signal.SIGTERM]
    if signalled:
        return min(signalled, key=lambda r: (failures[r]["timestamp"], r))
    silent = sorted(ranks - set(tracebacks) - {r for r in failures if failures[r]["exitcode"] == -signal.SIGTERM})
    if tracebacks and silent:
        return silent[0]
    if tracebacks:
        return min(tracebacks, key=lambda r: tracebacks[r]["time"])
    return min(failures, key=lambda r: (failures[r]["exitcode"] == -signal.SIGTERM, failures[r]["timestamp"], r))


_SKIP_FRAME = re.compile(r'  File "[^"]*(runpy\.py|<frozen runpy>|helpers/_bootstrap\.py)".*\n(    .*\n)*')


def _clean_traceback(text: str) -> str:
    """Drop the launcher's own frames and shorten paths so the learner sees their code."""
    text = _SKIP_FRAME.sub("", text)
    for base in (Path.cwd(), REPO_ROOT):
        text = text.replace(str(base) + os.sep, "")
    return re.sub(r'"/[^"]*/site-packages/', '".../site-packages/', text)


def _last_lines(text: str, count: int = 15) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-count:]) if lines else "(no output)"
