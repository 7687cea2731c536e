"""What one learner costs a machine, lesson by lesson: peak memory, peak processes, CPU-seconds.

    python -m helpers.tools.sizing                  # every lesson, one after another (a few minutes)
    python -m helpers.tools.sizing notebooks/02_ddp.ipynb
    python -m helpers.tools.sizing --inplace        # maintainers: also store the executed lessons

Each notebook runs top to bottom in a fresh kernel, as a learner's Run All would, on a copy (the lesson
itself is not rewritten). Meanwhile the kernel and everything it starts (the launch server, torchrun
agents, workers) are sampled every SAMPLE_SECONDS:
- peak memory is the largest sum of PSS over that process tree (proportional set size: a page shared by
  forked workers counts once in total, split between them; on Linux);
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
import time
from pathlib import Path

import psutil

from helpers import REPO_ROOT as ROOT

SAMPLE_SECONDS = 0.2
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


def measure(notebook: Path, inplace: bool = False) -> dict[str, float]:
    """Run one notebook in a fresh kernel and return its peak memory (MiB), processes and CPU-seconds.
    inplace: store the executed notebook (with the digits data, as the tests expect), like notebook_tools."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with tempfile.TemporaryDirectory() as scratch:
        started = time.perf_counter()
        command = [sys.executable, "-m", "helpers.tools.notebook_tools", str(notebook)]
        runner = subprocess.Popen(command + ([] if inplace else ["--no-store"]),
                                  stdout=subprocess.DEVNULL, stderr=open(Path(scratch) / "runner.log", "w"))
        handle = psutil.Process(runner.pid)
        peak_bytes, peak_processes = 0, 0
        while runner.poll() is None:
            processes = _tree(handle)  # the kernel and all below it; the runner itself is left out
            peak_processes = max(peak_processes, len(processes))
            peak_bytes = max(peak_bytes, sum(_pss(p) for p in processes))
            time.sleep(SAMPLE_SECONDS)
        seconds = time.perf_counter() - started
        _reap_all(time.time() + 10)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"peak MiB": peak_bytes / 2**20, "peak processes": peak_processes, "CPU-seconds": cpu,
            "wall seconds": seconds, "errors": runner.returncode != 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--inplace", action="store_true", help="store each executed lesson (maintainers)")
    args = parser.parse_args()
    _become_subreaper()
    notebooks = args.notebooks or sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    print(f"{'lesson':<44} {'peak MiB':>9} {'processes':>9} {'CPU-s':>7} {'wall s':>7}", flush=True)
    for notebook in notebooks:
        row = measure(notebook.resolve(), inplace=args.inplace)
        flag = "  (cells raised errors: see the lesson)" if row["errors"] else ""
        print(f"{notebook.name:<44} {row['peak MiB']:>9.0f} {row['peak processes']:>9} "
              f"{row['CPU-seconds']:>7.0f} {row['wall seconds']:>7.0f}{flag}", flush=True)
    print(f"\n{psutil.cpu_count()} cores, {psutil.virtual_memory().total / 2**30:.0f} GiB; "
          f"LESSONS_CPUS={os.environ.get('LESSONS_CPUS', 'unset')}")


if __name__ == "__main__":
    main()
