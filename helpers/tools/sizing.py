"""What one learner costs a machine, lesson by lesson: peak memory, peak processes, CPU-seconds.

    python -m helpers.tools.sizing                  # every lesson, one after another (a few minutes)
    python -m helpers.tools.sizing notebooks/02_ddp.ipynb
    python -m helpers.tools.sizing --inplace        # maintainers: also store the executed lessons
    python -m helpers.tools.sizing --budget-mib 2048 # exit 1 if a lesson plus the Jupyter server needs more

Each notebook runs top to bottom in a fresh kernel, as a learner's Run All would, on a copy (the lesson
itself is not rewritten). Meanwhile the kernel and everything it starts (the launch server, torchrun
agents, workers) are sampled every SAMPLE_SECONDS:
- peak memory is the largest sum of PSS over that process tree (proportional set size: a page shared by
  forked workers counts once in total, split between them; on Linux);
- at that peak, the PSS of each kind of process: the kernel, its launch server, torchrun agents (forked
  from the server, or fresh), workers, and anything else (a bare `torchrun` the lesson times);
- the Jupyter server a learner also runs is measured once (a JupyterLab server started and sampled
  after it answers) and added when the peak is checked against --budget-mib (default: budget_mib(), 2048 MiB or
  the lesson's own);
- peak processes is the largest number alive at once;
- CPU-seconds are user + system time of every process of the tree, reaped at the end (this script makes
  itself their subreaper on Linux, so nothing escapes the count), plus the notebook runner's own second or two.
The facilitator guide's table comes from this script.
"""
from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from helpers import REPO_ROOT as ROOT

SAMPLE_SECONDS = 0.2
BUDGET_MIB = 2048  # one learner: the lesson's peak plus the Jupyter server (docs/facilitator.md)
# Lessons that need more, each with its own budget (docs/facilitator.md says so to teachers). Lesson 05's RPC ranks:
# 2,289-2,481 MiB with the server on 6 December (its workers write most of the pages they share with the server).
LESSON_BUDGET_MIB = {"05_rpc.ipynb": 2688}


def budget_mib(name: str) -> float:
    """The budget a lesson's peak plus the Jupyter server must fit in: BUDGET_MIB, or the lesson's own."""
    return LESSON_BUDGET_MIB.get(name, BUDGET_MIB)
PR_SET_CHILD_SUBREAPER = 36


def _become_subreaper() -> None:
    """Orphaned grandchildren are handed to this process (not to init), so their CPU time is counted."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _tree(root: psutil.Process) -> list[psutil.Process]:
    try:
        return root.children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _pss(process: psutil.Process) -> int:
    try:
        info = process.memory_full_info()
        return getattr(info, "pss", info.rss)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return 0


def _reap_all(deadline: float) -> None:
    while time.time() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.05)


KINDS = ("kernel", "launch server", "agents", "workers", "other")


def _kind(process: psutil.Process, kernel: int, server: int | None) -> str:
    try:
        if process.pid == kernel:
            return "kernel"
        if process.pid == server:
            return "launch server"
        command = " ".join(process.cmdline())
        parent = process.ppid()
    except psutil.Error:
        return "other"
    if parent == server or "helpers.launcher.agent" in command or "torch.distributed.run" in command:
        return "agents"
    if "helpers.launcher" in command or "helpers/workers" in command:
        return "workers"
    return "other"


def _by_kind(processes: list[psutil.Process], sizes: list[int]) -> dict[str, float]:
    kernel = next((p.pid for p in processes if _cmdline(p).count("ipykernel")), -1)
    server = next((p.pid for p in processes if "helpers.launcher.server" in _cmdline(p) and _ppid(p) == kernel), None)
    kinds = dict.fromkeys(KINDS, 0.0)
    for process, size in zip(processes, sizes, strict=True):
        kinds[_kind(process, kernel, server)] += size / 2**20
    return kinds


def _ppid(process: psutil.Process) -> int | None:
    try:
        return process.ppid()
    except psutil.Error:  # it ended between the sample and this question
        return None


def _cmdline(process: psutil.Process) -> str:
    try:
        return " ".join(process.cmdline())
    except psutil.Error:
        return ""


def tree_mib(process: psutil.Process) -> float:
    """PSS of `process` and everything below it, in MiB."""
    return sum(_pss(p) for p in [process, *_tree(process)]) / 2**20


def idle_server_mib(server: psutil.Process, url: str, timeout: float = 60) -> float:
    """PSS of a JupyterLab server that answers at `url` (with its token) and has served its /lab page once: what
    a learner runs beside the lesson, idle. The browser test measures its own server this way."""
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=5).read()
            break
        except OSError:
            time.sleep(0.3)
    return tree_mib(server)


def jupyter_server_mib(timeout: float = 60) -> float:
    """PSS of an idle JupyterLab server, started here and stopped (what a learner runs beside the lesson)."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with tempfile.TemporaryDirectory() as root:
        server = subprocess.Popen([sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1",
                                   f"--port={port}", "--ServerApp.token=sizing", f"--ServerApp.root_dir={root}",
                                   "--allow-root"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            return idle_server_mib(psutil.Process(server.pid), f"http://127.0.0.1:{port}/lab?token=sizing", timeout)
        finally:
            server.terminate()
            server.wait(timeout=30)


class PeakSampler:
    """Samples the PSS of a process tree every SAMPLE_SECONDS on a thread of its own, from start() to stop(), and keeps
    the peak, the split by kind at that peak and the most processes alive at once. `root` itself is counted when
    include_root (a kernel, as JupyterLab starts it) and left out when not (the notebook runner above a kernel)."""

    def __init__(self, root: psutil.Process, include_root: bool = False):
        self.root, self.include_root = root, include_root
        self.peak_bytes, self.peak_processes, self.at_peak = 0, 0, dict.fromkeys(KINDS, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sizing-sampler", daemon=True)

    def start(self) -> PeakSampler:
        self._thread.start()
        return self

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"peak MiB": self.peak_bytes / 2**20, "peak processes": self.peak_processes, "at peak": self.at_peak}

    def _run(self) -> None:
        while True:
            self.sample()
            if self._stop.wait(SAMPLE_SECONDS):
                self.sample()  # and once more at the end, so a run shorter than a period is seen
                return

    def sample(self) -> None:
        processes = ([self.root] if self.include_root else []) + _tree(self.root)
        sizes = [_pss(p) for p in processes]
        self.peak_processes = max(self.peak_processes, len(processes))
        if sum(sizes) > self.peak_bytes:
            self.peak_bytes, self.at_peak = sum(sizes), _by_kind(processes, sizes)


def measure(notebook: Path, inplace: bool = False) -> dict[str, float]:
    """Run one notebook in a fresh kernel and return its peak memory (MiB), processes and CPU-seconds.
    inplace: store the executed notebook (with the digits data, as the tests expect), like notebook_tools."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        command = [sys.executable, "-m", "helpers.tools.notebook_tools", str(notebook)]
        runner = subprocess.Popen(command + ([] if inplace else ["--no-store"]),
                                  stdout=subprocess.DEVNULL, stderr=open(Path(scratch) / "runner.log", "w"))
        sampler = PeakSampler(psutil.Process(runner.pid)).start()  # the kernel and all below it, not the runner
        runner.wait()
        figures = sampler.stop()
        seconds = time.perf_counter() - started
        _reap_all(time.time() + 10)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {**figures, "CPU-seconds": cpu, "wall seconds": seconds, "errors": runner.returncode != 0}


def header() -> str:
    return (f"{'lesson':<40} {'peak MiB':>8} {'+server':>8} " + " ".join(f"{k:>13}" for k in KINDS)
            + f" {'processes':>9} {'CPU-s':>6} {'wall s':>6}")


def row(name: str, figures: dict, server_mib: float, budget_mib: float) -> tuple[str, bool]:
    """The table's line for one lesson, and whether it fails: cells raised errors, or the peak plus the Jupyter server
    is over budget_mib. CPU-seconds and wall seconds read "-" where `figures` lacks them."""
    total = figures["peak MiB"] + server_mib
    over = total > budget_mib
    flags = ("  (cells raised errors: see the lesson)" if figures["errors"] else "") + \
            (f"  OVER {budget_mib:.0f} MiB" if over else "")
    seconds = " ".join(f"{figures[k]:>6.0f}" if k in figures else f"{'-':>6}" for k in ("CPU-seconds", "wall seconds"))
    line = (f"{name:<40} {figures['peak MiB']:>8.0f} {total:>8.0f} "
            + " ".join(f"{figures['at peak'][k]:>13.0f}" for k in KINDS)
            + f" {figures['peak processes']:>9} {seconds}{flags}")
    return line, over or figures["errors"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--inplace", action="store_true", help="store each executed lesson (maintainers)")
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="peak + Jupyter server allowed per learner (default: each lesson's budget_mib)")
    args = parser.parse_args()
    _become_subreaper()
    notebooks = args.notebooks or [path for pattern in ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")  # lessons, appendices
                                   for path in sorted((ROOT / "notebooks").glob(pattern))]
    probe = "import torch; print(torch.__version__, torch.version.cuda or 'cpu')"
    build = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.split()
    print(f"torch {build[0]} ({'CPU-only build' if build[1] == 'cpu' else 'CUDA ' + build[1] + ' build'}): every "
          "process that imports torch maps its libraries, so a CPU-only build (binder/requirements.txt) costs less")
    server = jupyter_server_mib()
    print(f"Jupyter server (JupyterLab, idle): {server:.0f} MiB, added to each lesson's peak for the budget of "
          + (f"{args.budget_mib:.0f} MiB" if args.budget_mib else
             f"{BUDGET_MIB} MiB ({', '.join(f'{k}: {v} MiB' for k, v in LESSON_BUDGET_MIB.items())})"), flush=True)
    print(header(), flush=True)
    over = []
    for notebook in notebooks:
        line, failed = row(notebook.name, measure(notebook.resolve(), inplace=args.inplace), server,
                           args.budget_mib or budget_mib(notebook.name))
        if failed:
            over.append(notebook.name)
        print(line, flush=True)
    print(f"\n{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"LESSONS_CPUS={os.environ.get('LESSONS_CPUS', 'unset')}")
    if over:
        print(f"Over budget or failing: {', '.join(over)}")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
