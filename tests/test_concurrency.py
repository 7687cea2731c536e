"""A room on one server: eight learners' kernels launch jobs at the same moment.

Slow (a minute or two on 2 cores), so it is marked `slow`: `pytest -m slow tests/test_concurrency.py`.
`.ci/run` runs it after the main suite. It checks what a teacher needs to know: every launch of every
learner succeeds (no port clash between concurrent rendezvous), and after the kernels shut down no
launch server, agent or worker of any learner is left running. It prints the slowdown against one
learner alone, for the facilitator guide.
"""
import json
import os
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers import WORKERS
from helpers.launcher.run_folder import alive

jupyter_client = pytest.importorskip("jupyter_client")
pytestmark = pytest.mark.slow

WHOAMI = WORKERS / "whoami.py"
LEARNERS = 8
LAUNCHES = 3
LEARNER_CELL = f"""
import json, time
from helpers import launch
started, ports = time.perf_counter(), []
for _ in range({LAUNCHES}):
    run = launch({str(WHOAMI)!r}, nproc=2, echo=False, timeout=300)
    assert sorted(r["rank_sum"] for r in run.results.values()) == [1.0, 1.0], run.results
    ports.append(int(run.results[0]["MASTER_PORT"]))
print("RESULT " + json.dumps({{"seconds": time.perf_counter() - started, "ports": ports}}))
"""


def _learner(folder: Path, outcome: dict, index: int) -> None:
    manager, client = jupyter_client.manager.start_new_kernel(kernel_name="python3", cwd=str(folder),
                                                              env={**os.environ, "LESSONS_CPUS": "1"})
    texts, errors = [], []

    def collect(message):
        content = message["content"]
        if message["msg_type"] == "stream":
            texts.append(content["text"])
        elif message["msg_type"] == "error":
            errors.append(f"{content['ename']}: {content['evalue']}")

    try:
        client.execute_interactive(LEARNER_CELL, timeout=600, output_hook=collect)
        kernel = psutil.Process(manager.provisioner.process.pid)
        pids = [kernel.pid] + [child.pid for child in kernel.children(recursive=True)]
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=False)
    line = next((t for t in "".join(texts).splitlines() if t.startswith("RESULT ")), None)
    outcome[index] = {"errors": errors, "pids": pids, **(json.loads(line[7:]) if line else {"seconds": None})}


def _room(folder: Path, learners: int) -> dict:
    outcome: dict = {}
    threads = [threading.Thread(target=_learner, args=(folder / f"learner{i}", outcome, i)) for i in range(learners)]
    for i, thread in enumerate(threads):
        (folder / f"learner{i}").mkdir(parents=True)
        thread.start()
    for thread in threads:
        thread.join()
    return outcome


def _alive(pids: list[int]) -> list[int]:
    return [pid for pid in pids if alive(pid)]


def test_eight_learners_launch_at_once(tmp_path):
    alone = _room(tmp_path / "alone", 1)[0]
    assert not alone["errors"] and alone["seconds"], alone
    room = _room(tmp_path / "room", LEARNERS)
    failed = {i: r["errors"] for i, r in room.items() if r["errors"] or r["seconds"] is None}
    assert not failed, f"learners whose launches failed: {failed}"  # catches port clashes and crashes
    time.sleep(2)  # give shut-down kernels' process trees a moment to be reaped
    leftovers = _alive([pid for r in [alone, *room.values()] for pid in r["pids"]])
    assert not leftovers, f"processes left running after the kernels shut down: {leftovers}"
    times = sorted(r["seconds"] for r in room.values())
    print(f"\n{LAUNCHES} launches of 2 ranks: one learner alone {alone['seconds']:.1f} s; "
          f"{LEARNERS} at once: median {times[len(times) // 2]:.1f} s, slowest {times[-1]:.1f} s "
          f"(slowdown {times[len(times) // 2] / alone['seconds']:.1f}x median), "
          f"{len({p for r in room.values() for p in r['ports']})} distinct rendezvous ports")
