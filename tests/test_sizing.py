"""`python -m helpers.tools.sizing`, the teachers' tool behind docs/facilitator.md's memory table, measures what it
says. Every lesson's own memory is checked during its browser Run All (tests/test_browser.py, with this tool's
sampler and budget). Here the sampler is checked on a planted process tree (a few seconds), and the tool itself runs
end to end on two small notebooks (slow: it starts a JupyterLab server and two kernels, about half a minute).
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import psutil
import pytest

from helpers import REPO_ROOT
from helpers.tools import sizing

TICKER = REPO_ROOT / "tests" / "workers" / "ticker.py"
# writes every page of MIB MiB (a zeroed bytearray would be mapped but not touched, so not resident)
ALLOCATE = "import time; block = bytes(range(256)) * ({mib} * 4096); print('ready', flush=True); time.sleep(60)"
COLUMNS = ["lesson", "peak", "+server", "kernel", "launch server", "agents", "workers", "other", "processes", "CPU-s",
           "wall s"]


def _notebook(path, cells: list[str]) -> None:
    path.write_text(json.dumps({
        "cells": [{"cell_type": "code", "metadata": {}, "source": [source], "outputs": [], "execution_count": None}
                  for source in cells],
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
        "nbformat": 4, "nbformat_minor": 5}))


def _spawning(code: str) -> str:
    """Python code that runs `code` in a child interpreter and waits for it."""
    return f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"


def test_the_sampler_sees_a_grandchild_allocate_and_counts_each_process_once():
    """200 MiB written by the root's grandchild shows in the peak (a sampler that reads only the root's direct
    children misses it; one that adds a process twice reads twice the size); three bare interpreters add tens of MiB,
    not hundreds."""
    root = subprocess.Popen([sys.executable, "-c", _spawning(_spawning(ALLOCATE.format(mib=200)))],
                            stdout=subprocess.PIPE, text=True)
    try:
        sampler = sizing.PeakSampler(psutil.Process(root.pid), include_root=True).start()
        assert root.stdout.readline().strip() == "ready"
        time.sleep(3 * sizing.SAMPLE_SECONDS)
        figures = sampler.stop()
    finally:
        for process in [*psutil.Process(root.pid).children(recursive=True), psutil.Process(root.pid)]:
            process.kill()
        root.wait()
    assert figures["peak processes"] == 3, figures
    assert 200 <= figures["peak MiB"] < 200 + 100, figures
    assert figures["at peak"]["other"] == pytest.approx(figures["peak MiB"]), figures  # no kernel, no launcher here


@pytest.mark.slow
def test_the_tool_measures_a_launch_by_kind_and_flags_errors_and_the_budget(tmp_path):
    """A notebook that launches two ranks (ticking for 3 s) is sampled by kind: the kernel, its launch server, an
    agent and two workers are all seen at the peak; a notebook whose cell raises is flagged; with a budget of 1 MiB
    both are over it and the tool exits 1."""
    _notebook(tmp_path / "launches.ipynb", [f"from helpers import launch\nrun = launch({str(TICKER)!r}, nproc=2, "
                                            "args=['--seconds', '3'], echo=False)"])
    _notebook(tmp_path / "fails.ipynb", ["raise RuntimeError('planted')"])
    done = subprocess.run([sys.executable, "-m", "helpers.tools.sizing", "--budget-mib", "1",
                           str(tmp_path / "launches.ipynb"), str(tmp_path / "fails.ipynb")],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 1, (done.stdout, done.stderr[-2000:])
    server = re.search(r"Jupyter server \(JupyterLab, idle\): (\d+) MiB", done.stdout)
    assert server and int(server[1]) > 30, done.stdout  # a Python web server with JupyterLab's extensions loaded
    rows = {line.split()[0]: line for line in done.stdout.splitlines()
            if line.split()[:1] in (["launches.ipynb"], ["fails.ipynb"])}
    assert sorted(rows) == ["fails.ipynb", "launches.ipynb"], done.stdout
    launches = dict(zip(COLUMNS, rows["launches.ipynb"].split(), strict=False))
    assert abs(int(launches["+server"]) - int(launches["peak"]) - int(server[1])) <= 1, rows["launches.ipynb"]
    for kind in ("kernel", "launch server", "agents", "workers"):
        assert int(launches[kind]) > 0, f"{kind} not seen at the peak: {rows['launches.ipynb']}"
    assert int(launches["processes"]) >= 5, rows["launches.ipynb"]  # kernel, launch server, agent, two workers
    assert int(launches["CPU-s"]) > 0, rows["launches.ipynb"]
    assert "OVER 1 MiB" in rows["launches.ipynb"] and "cells raised errors" not in rows["launches.ipynb"]
    assert "cells raised errors" in rows["fails.ipynb"] and "OVER 1 MiB" in rows["fails.ipynb"]
    assert "Over budget or failing: launches.ipynb, fails.ipynb" in done.stdout


def test_each_lesson_budget_names_a_lesson_and_only_raises_the_default():
    """The lessons given a budget of their own exist, and only get more than the default (docs/facilitator.md lists
    them for teachers); every other lesson is held to sizing.BUDGET_MIB."""
    assert sizing.LESSON_BUDGET_MIB
    assert all((REPO_ROOT / "notebooks" / name).exists() for name in sizing.LESSON_BUDGET_MIB)
    assert all(budget > sizing.BUDGET_MIB for budget in sizing.LESSON_BUDGET_MIB.values())
    assert sizing.budget_mib("00_start_here.ipynb") == sizing.BUDGET_MIB
    assert sizing.budget_mib("05_rpc.ipynb") == sizing.LESSON_BUDGET_MIB["05_rpc.ipynb"]
