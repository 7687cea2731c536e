"""The lessons as a learner meets them: JupyterLab in a real (headless) Chromium. Every test here is in the slow set
(README, "More checks"): `pytest --nbval` leaves them out, .ci/run runs them after it.

    pytest -m slow tests/test_browser.py -k "not run_all"    # the smoke set: a worker link, live output, interrupt,
                                                              # kernel restart, the explorers (about a minute)
    pytest -m slow tests/test_browser.py                     # and Run All of every lesson, from blank copies, with
                                                              # its memory against the learner's budget

Needs Chromium from the system's packages (`apt-get install chromium`) and the `playwright` Python
package, which drives it through `executable_path` (no browser download). Without them every test here
is skipped with one line saying why. JupyterLab runs with `--LabApp.expose_app_in_browser=True`, so
the tests call the same commands a learner clicks (`notebook:run-all-cells`, `notebook:interrupt-kernel`).

Each lesson's Run All is also its memory check: `helpers.tools.sizing`'s sampler reads the PSS of the lesson's
kernel and everything it starts every 0.2 s, and the peak plus this JupyterLab server (measured idle, as sizing
measures one) must stay within sizing's budget. `python -m helpers.tools.sizing` prints the same row for a teacher.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from helpers import REPO_ROOT as ROOT
from helpers.tools import sizing, workshop

CHROMIUM = os.environ.get("LESSONS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
playwright = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(CHROMIUM is None, reason="no Chromium found (apt-get install chromium)")]
LESSONS = sorted(p.name for pattern in ("[0-9][0-9]_*.ipynb", "A[0-9]_*.ipynb")  # lessons, then appendices
                 for p in (ROOT / "notebooks").glob(pattern))
BUDGET_SECONDS = 360  # one lesson's Run All; nbval's budget is about 3 minutes on a quiet 2-core machine
TICKER = ROOT / "tests" / "workers" / "ticker.py"
WHOAMI = ROOT / "helpers" / "workers" / "whoami.py"
TOKEN = "lessons-browser-test"
ANSI = re.compile(r"\x1b\[[0-9;]*m")
EXPLORERS = ["allreduce_explorer(0.7e-3, 0.5e9, [1e3, 1e6], [0.8e-3, 2.7e-3])", "bucket_explorer(mlp(256, 14))",
             "memory_explorer()", "pipeline_explorer()"]
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-sync",
                  "--disable-background-networking", "--disable-component-update"]

CELLS_JS = """() => {
  const panel = window.jupyterapp.shell.currentWidget;
  const kernel = panel.sessionContext.session && panel.sessionContext.session.kernel;
  const cells = [];
  for (const cell of panel.content.model.cells) {
    if (cell.type !== 'code') { continue; }
    cells.push({count: cell.executionCount, tags: cell.getMetadata('tags') || [],
                source: cell.sharedModel.getSource().slice(0, 80),
                outputs: cell.outputs.toJSON()});
  }
  return {status: kernel ? kernel.status : 'none', running: panel.content.widgets.filter(
            w => w.model.type === 'code' && w.promptNode && w.promptNode.textContent.includes('*')).length,
          cells};
}"""


def _notebook(cells: list[str]) -> dict:
    return {"cells": [{"cell_type": "code", "metadata": {}, "source": [source], "outputs": [],
                       "execution_count": None} for source in cells],
            "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
            "nbformat": 4, "nbformat_minor": 5}


@pytest.fixture(scope="module")
def lab_root(tmp_path_factory) -> Path:
    """Blank copies of every lesson (outputs cleared) beside the helpers they import, as a learner clones them."""
    root = tmp_path_factory.mktemp("lab")
    workshop.write_copy(root, student=False, clear_outputs=True)
    scratch = [
        f"from helpers import launch\nrun = launch({str(TICKER)!r}, nproc=2, args=['--seconds', '60'])",
        f"run = launch({str(WHOAMI)!r}, nproc=2)\nprint('whoami ranks', sorted(run.results))",
    ]
    (root / "notebooks" / "scratch.ipynb").write_text(json.dumps(_notebook(scratch)))
    explorers = ["%matplotlib inline\nfrom helpers.lessons import explorers\nfrom helpers.kit.models import mlp",
                 *[f"explorers.{call}" for call in EXPLORERS]]
    (root / "notebooks" / "explorers.ipynb").write_text(json.dumps(_notebook(explorers)))
    return root


class Lab(NamedTuple):
    url: str
    server: psutil.Process
    idle_mib: float  # the server's PSS once it has served /lab and before any notebook opens


@pytest.fixture(scope="module")
def lab(lab_root):
    """A JupyterLab server on a free loopback port; stopped (kernels and all) after the module."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = open(lab_root / "lab.log", "w")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         f"--ServerApp.token={TOKEN}", f"--ServerApp.root_dir={lab_root}", "--LabApp.expose_app_in_browser=True",
         "--allow-root"], stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "LESSONS_DATA": "digits"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={TOKEN}", timeout=2)
            break
        except OSError:
            time.sleep(0.3)
    else:
        server.kill()
        pytest.fail(f"JupyterLab did not start in 60 s; see {lab_root / 'lab.log'}")
    handle = psutil.Process(server.pid)
    yield Lab(url, handle, sizing.idle_server_mib(handle, f"{url}/lab?token={TOKEN}"))
    server.terminate()
    server.wait(timeout=30)
    log.close()


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield chromium
        chromium.close()


def _kernel_processes(server: psutil.Process) -> list[psutil.Process]:
    """The live kernels of `server`. A kernel that was just restarted or shut down can linger as a zombie (or
    vanish) until the server reaps it; it is no longer a kernel, so it is skipped rather than read."""
    return [child for child in server.children() if "ipykernel" in _cmdline(child)]


def _cmdline(process: psutil.Process) -> str:
    """`process`'s command line, or "" once it has exited or is a zombie (psutil.ZombieProcess is a NoSuchProcess)."""
    try:
        return "" if process.status() == psutil.STATUS_ZOMBIE else " ".join(process.cmdline())
    except psutil.NoSuchProcess:
        return ""


def _own_kernel(page, server: psutil.Process) -> psutil.Process:
    """The kernel process of the notebook open in `page` (its connection file names the kernel id)."""
    kernel_id = page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.id")
    deadline = time.monotonic() + 10  # a kernel that is restarting has no process for a moment
    while True:
        found = [p for p in _kernel_processes(server) if f"kernel-{kernel_id}.json" in _cmdline(p)]
        if len(found) == 1 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(found) == 1, f"kernel {kernel_id}: {found}"
    return found[0]


def _open(browser, lab, name: str):
    """A new page with notebook `name` open and its kernel idle."""
    url = lab.url
    page = browser.new_page()
    # reset: a fresh workspace, so JupyterLab does not reopen (and start kernels for) earlier tests' notebooks
    page.goto(f"{url}/lab/tree/notebooks/{name}?reset&token={TOKEN}")
    page.wait_for_function("""() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
        return w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel
               && w.sessionContext.session.kernel.status === 'idle'; }""", timeout=120_000)
    return page


def _close(page, lab) -> None:
    """Shut the notebook's kernel down (as File > Close and Shut Down does) and close the page: the kernel
    and everything it started must be gone."""
    url, server = lab.url, lab.server
    kernel = _own_kernel(page, server)
    tree = {p.pid for p in [kernel, *kernel.children(recursive=True)]}
    kernel_id = page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.id")
    # JupyterLab's shutdown can reject ("Unhandled error") right after a kernel restart; then shut the kernel down
    # through the server's REST API, as JupyterLab's running-kernels panel does. Either way everything must go.
    refused = page.evaluate("""async () => {
        try { await window.jupyterapp.shell.currentWidget.sessionContext.shutdown(); return null; }
        catch (error) { return String(error); } }""")
    if refused:
        request = urllib.request.Request(f"{url}/api/kernels/{kernel_id}?token={TOKEN}", method="DELETE")
        try:
            urllib.request.urlopen(request, timeout=30)
        except urllib.error.HTTPError as error:  # 404: the refused shutdown had ended the kernel after all
            if error.code != 404:
                raise
    page.close()
    deadline = time.monotonic() + 30
    while _descendants_alive(tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _descendants_alive(tree), f"left running after shutting the kernel down: {_descendants_alive(tree)}"


def _command(page, command: str) -> None:
    """Start a JupyterLab command as a click would, without waiting for it to finish."""
    page.evaluate(f"() => {{ window.jupyterapp.commands.execute({command!r}); }}")


def _state(page) -> dict:
    return page.evaluate(CELLS_JS)


def _wait(page, condition, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(page)
        if condition(state):
            return state
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout:.0f} s; last state:\n{_summary(state)}")


def _summary(state: dict) -> str:
    """One line per code cell: its count, its errors and the start of its source, so a stalled Run All
    shows where it stopped and why."""
    lines = [f"kernel {state['status']}, {state['running']} cell(s) running"]
    for index, cell in enumerate(state["cells"]):
        errors = [f"{o['ename']}: {o['evalue'][:300]}" for o in cell["outputs"] if o["output_type"] == "error"]
        source = cell["source"].replace("\n", " | ")[:60]
        lines.append(f"  code cell {index:2d} [{cell['count'] or ' '}] {source}  {'; '.join(errors)}".rstrip())
    return "\n".join(lines)


def _text(outputs: list[dict]) -> str:
    parts = []
    for output in outputs:
        if output["output_type"] == "stream":
            parts.append(output["text"] if isinstance(output["text"], str) else "".join(output["text"]))
        elif output["output_type"] == "error":
            parts.append("\n".join(output["traceback"]))
        else:
            text = output.get("data", {}).get("text/plain", "")
            parts.append(text if isinstance(text, str) else "".join(text))
    return "".join(parts)


def _job_processes(server: psutil.Process) -> set[int]:
    """Agents and workers under the notebook's kernel: every descendant but the launch server itself."""
    pids = set()
    for kernel in _kernel_processes(server):
        try:
            children = kernel.children(recursive=True)
        except psutil.Error:  # the kernel exited since it was listed
            continue
        for process in children:
            try:
                if "helpers.launcher.server" not in " ".join(process.cmdline()) or process.ppid() != kernel.pid:
                    pids.add(process.pid)
            except psutil.Error:
                pass
    return pids


def _descendants_alive(pids: set[int]) -> list[str]:
    alive = []
    for pid in pids:
        try:
            process = psutil.Process(pid)
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(f"{pid} {' '.join(process.cmdline())[:100]}")
        except psutil.NoSuchProcess:
            pass
    return alive


def run_all(browser, lab, name: str) -> tuple[float, dict]:
    """Run All in JupyterLab; every code cell must run, no error outside `raises-exception` cells. Returns the
    seconds it took and sizing's figures for the kernel's process tree meanwhile (peak PSS, by kind, processes)."""
    page = _open(browser, lab, name)
    sampler = sizing.PeakSampler(_own_kernel(page, lab.server), include_root=True).start()
    started = time.monotonic()
    _command(page, "notebook:run-all-cells")
    try:
        state = _wait(page, lambda s: s["status"] == "idle" and all(c["count"] for c in s["cells"]),
                      BUDGET_SECONDS, f"{name}: Run All did not reach every cell")
    finally:
        seconds = time.monotonic() - started
        figures = sampler.stop()
        _close(page, lab)
    unexpected = [(c["source"], o["ename"], o["evalue"][:200]) for c in state["cells"] for o in c["outputs"]
                  if o["output_type"] == "error" and "raises-exception" not in c["tags"]]
    assert not unexpected, f"{name}: errors in cells that should not raise: {unexpected}"
    return seconds, {**figures, "errors": False, "wall seconds": seconds}


@pytest.mark.parametrize("name", LESSONS)
def test_run_all_lesson_within_the_memory_budget(browser, lab, name):
    """A learner's Run All of the lesson, and what it costs: the peak PSS of the kernel's tree plus the idle
    JupyterLab server within the lesson's budget, sizing.budget_mib (docs/facilitator.md, "What one learner costs a
    machine")."""
    seconds, figures = run_all(browser, lab, name)
    budget = sizing.budget_mib(name)
    line, over = sizing.row(name, figures, lab.idle_mib, budget)
    print(f"\n{name}: Run All took {seconds:.0f} s in JupyterLab; JupyterLab server idle {lab.idle_mib:.0f} MiB, "
          f"now {sizing.tree_mib(lab.server):.0f} MiB\n{sizing.header()}\n{line}")
    assert figures["peak processes"] >= 1 and figures["at peak"]["kernel"] > 0, f"the sampler saw no kernel: {line}"
    assert not over, f"over the budget of {budget:.0f} MiB with the Jupyter server:\n{sizing.header()}\n{line}"


def test_a_link_to_a_worker_opens_the_worker_file(browser, lab):
    """Lessons link to their workers as ../helpers/workers/NAME.py: with the server rooted at the repository (as
    the README starts it), a click opens the file in JupyterLab."""
    url = lab.url
    page = browser.new_page()
    try:
        page.goto(f"{url}/lab/tree/notebooks/02_ddp.ipynb?reset&token={TOKEN}")
        link = page.locator(".jp-RenderedMarkdown a", has_text="ddp_launch_env.py").first
        link.wait_for(timeout=120_000)
        link.click()
        page.wait_for_function("() => window.jupyterapp.shell.currentWidget.title.label === 'ddp_launch_env.py'",
                               timeout=30_000)  # catches a 404 or a link that opens nothing
        text = page.evaluate("() => window.jupyterapp.shell.currentWidget.content.model.sharedModel.getSource()")
        assert text == (ROOT / "helpers" / "workers" / "ddp_launch_env.py").read_text(), text[:200]  # not another file
    finally:
        page.evaluate("() => window.jupyterapp.serviceManager.sessions.shutdownAll()")  # no dialog, unlike the menu
        page.close()


def test_live_output_interrupt_and_next_launch(browser, lab):
    page = _open(browser, lab, "scratch.ipynb")
    server = lab.server
    try:
        _command(page, "notebook:run-cell")
        # live: rank-labelled ticks appear while the cell is still running (a buffered launcher shows none)
        state = _wait(page, lambda s: "tick 3 from rank 1" in _text(s["cells"][0]["outputs"]), 90,
                      "live rank output while the cell runs")
        assert not state["cells"][0]["count"], "the cell should still be running"
        kernel_tree = {p.pid for p in _own_kernel(page, server).children(recursive=True)}
        workers = _job_processes(server)
        assert len(workers) >= 3, "an agent and two ticker workers should be running now"
        _command(page, "notebook:interrupt-kernel")
        state = _wait(page, lambda s: s["cells"][0]["count"], 30, "the cell ends after an interrupt")
        errors = [o for o in state["cells"][0]["outputs"] if o["output_type"] == "error"]
        assert errors, "the interrupted cell should end in an error the learner sees"
        traceback = "\n".join(errors[0]["traceback"])
        assert "helpers/launcher/" not in traceback, traceback  # none of the launcher's frames
        assert len(traceback.splitlines()) < 40, f"a wall of text for an interrupt:\n{traceback}"
        time.sleep(1)
        assert not _descendants_alive(workers), f"survived the interrupt: {_descendants_alive(workers)}"
        # the same kernel launches again
        page.evaluate("() => { window.jupyterapp.shell.currentWidget.content.activeCellIndex = 1; }")
        _command(page, "notebook:run-cell")
        state = _wait(page, lambda s: s["cells"][1]["count"], 90, "the next launch")
        assert "whoami ranks [0, 1]" in _text(state["cells"][1]["outputs"]), state["cells"][1]["outputs"]
    finally:
        _close(page, lab)
    assert not [p for p in _descendants_alive(kernel_tree) if "ipykernel" not in p]


def test_kernel_restart_during_a_launch_leaves_nothing(browser, lab):
    page = _open(browser, lab, "scratch.ipynb")
    server = lab.server
    try:
        _command(page, "notebook:run-cell")
        _wait(page, lambda s: "tick 2 from rank 0" in _text(s["cells"][0]["outputs"]), 90, "ticks before restart")
        kernel = _own_kernel(page, server)
        tree = {p.pid for p in [kernel, *kernel.children(recursive=True)]}
        assert len(tree) >= 5, "kernel, launch server, agent and two workers should be alive"
        page.evaluate("() => { window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart(); }")
        deadline = time.monotonic() + 15
        while _descendants_alive(tree) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not _descendants_alive(tree), f"left running after a kernel restart: {_descendants_alive(tree)}"
        # and the restarted kernel comes back usable, as the learner expects (its new process is what _close ends)
        page.wait_for_function("""() => { const k = window.jupyterapp.shell.currentWidget.sessionContext.session.kernel;
            return k && k.status === 'idle'; }""", timeout=60_000)
    finally:
        _close(page, lab)


def test_every_explorer_renders_and_follows_its_controls(browser, lab):
    page = _open(browser, lab, "explorers.ipynb")
    try:
        _command(page, "notebook:run-all-cells")
        state = _wait(page, lambda s: all(c["count"] for c in s["cells"]), 120, "the explorer cells")
        assert not [o for c in state["cells"] for o in c["outputs"] if o["output_type"] == "error"], state
        areas = page.locator(".jp-Cell-outputArea")
        _wait(page, lambda s: page.locator(".jp-Cell-outputArea img").count() >= len(EXPLORERS), 60,
              "a figure in every explorer")
        for index, call in enumerate(EXPLORERS, start=1):
            area = areas.nth(index)
            assert "Error displaying widget" not in area.inner_text(), call
            before = area.locator("img").first.get_attribute("src")
            handle = area.locator(".noUi-handle").first  # the first slider, moved as a learner's arrow key would
            for _ in range(3):  # a keypress can land before JupyterLab hands focus to the handle: press again
                handle.scroll_into_view_if_needed()
                handle.press("ArrowRight")
                deadline = time.monotonic() + 10
                while area.locator("img").first.get_attribute("src") == before and time.monotonic() < deadline:
                    time.sleep(0.3)
                if area.locator("img").first.get_attribute("src") != before:
                    break
            assert area.locator("img").first.get_attribute("src") != before, f"{call}: the figure did not change"
    finally:
        _close(page, lab)


LIVE_CELLS = ["%load_ext helpers\n%ranks start -n 2",
              "%%ranks\nx = torch.ones(2) * (rank + 1)\ndist.all_reduce(x)\nprint(x)",
              "%%ranks 0\nprint('joining', flush=True)\ndist.all_reduce(x)",  # rank 1 never joins: a hang
              "%ranks restart",
              "%%ranks\ny = torch.ones(1)\ndist.all_reduce(y)\nprint('after the restart', y)"]


def test_live_ranks_and_stop_on_a_hung_cell(browser, lab, lab_root):
    """%%ranks in JupyterLab (issue 37): labelled output, then ■ Stop on a collective only rank 0 joins ends the cell
    and says where each rank was and that the process group is broken; %ranks restart brings the group back."""
    (lab_root / "notebooks" / "live_ranks.ipynb").write_text(json.dumps(_notebook(LIVE_CELLS)))
    page = _open(browser, lab, "live_ranks.ipynb")

    def run(index: int, until, what: str, timeout: float = 120) -> dict:
        page.evaluate(f"() => {{ window.jupyterapp.shell.currentWidget.content.activeCellIndex = {index}; }}")
        _command(page, "notebook:run-cell")
        return _wait(page, lambda s: until(s["cells"][index]), timeout, what)

    try:
        run(0, lambda c: c["count"] and "joined the process group" in _text(c["outputs"]), "%ranks start")
        state = run(1, lambda c: c["count"], "the all_reduce cell")
        shown = ANSI.sub("", _text(state["cells"][1]["outputs"]))
        assert "[rank 0] tensor([3., 3.])\n[rank 1] tensor([3., 3.])" in shown, shown
        run(2, lambda c: "[rank 0] joining" in ANSI.sub("", _text(c["outputs"])), "the hung cell's first line")
        time.sleep(1)
        assert not _state(page)["cells"][2]["count"], "the hung cell should still be running"
        interrupted = time.monotonic()
        _command(page, "notebook:interrupt-kernel")
        state = _wait(page, lambda s: s["cells"][2]["count"], 30, "the hung cell ends after ■ Stop")
        elapsed = time.monotonic() - interrupted
        errors = [o for o in state["cells"][2]["outputs"] if o["output_type"] == "error"]
        assert errors, "the interrupted cell should end in an error the learner sees"
        traceback = ANSI.sub("", "\n".join(errors[0]["traceback"]))
        number = state["cells"][2]["count"]
        assert f"rank 0: waiting in dist.all_reduce at In[{number}]:3; still there" in traceback, traceback
        assert "rank 1: not running this cell" in traceback and "The process group is broken" in traceback
        assert "%ranks restart" in traceback and "helpers/launcher" not in traceback, traceback
        assert len(traceback.splitlines()) < 40, f"a wall of text for an interrupt:\n{traceback}"
        assert elapsed < 5, f"■ Stop took {elapsed:.1f} s to end the cell, as the browser saw it"
        run(3, lambda c: c["count"] and "joined the process group" in _text(c["outputs"]), "%ranks restart")
        state = run(4, lambda c: c["count"], "a cell after the restart")
        assert "[rank 1] after the restart tensor([2.])" in ANSI.sub("", _text(state["cells"][4]["outputs"]))
    finally:
        _close(page, lab)
