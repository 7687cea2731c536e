"""On one host, a learner's job is reachable by any other process on the same loopback; its own network
namespace closes that. What docs/facilitator.md ("Isolation between learners") rests on. In the slow set (README,
"More checks"): `pytest -m slow tests/test_isolation.py`; .ci/run runs it after `pytest --nbval`."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO_ROOT, start, wait

pytestmark = pytest.mark.slow
NEIGHBOUR = REPO_ROOT / "tests" / "workers" / "store_neighbour.py"
# A process that is not part of the job: it only knows the port, as a scan of 127.0.0.1 would find it.
STRANGER = """
import sys
from datetime import timedelta
import torch.distributed as dist
try:
    store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=float(sys.argv[2])))
except Exception as error:
    print("unreachable:", type(error).__name__)
    sys.exit(0)
print("read:", store.get("lesson/secret").decode())
store.set("lesson/intruder", "a stranger's key")
print("wrote: lesson/intruder")
"""


def _port(port_file: Path, limit: float = 60) -> int:
    deadline = time.monotonic() + limit
    while not port_file.exists() or not port_file.read_text():
        assert time.monotonic() < deadline, "rank 0 never said where its store is"
        time.sleep(0.05)
    return int(port_file.read_text())


def _stranger(port: int, patience: float = 5) -> str:
    """What a stranger that knows only the port gets; `patience`: seconds it keeps trying to connect (a store that
    listens answers at once, so a short patience only shortens the wait where nothing answers)."""
    return subprocess.run([sys.executable, "-c", STRANGER, str(port), str(patience)], capture_output=True, text=True,
                          timeout=120).stdout


def test_a_process_outside_the_job_reads_and_writes_its_store_on_a_shared_loopback(tmp_path):
    port_file = tmp_path / "port"
    job = start(NEIGHBOUR, nproc=2, args=["--port-file", port_file, "--wait", 60], echo=False)
    seen = _stranger(_port(port_file))
    run = wait([job], timeout=120)[0]
    assert "read: rank 0's value" in seen, seen  # catches a store that refused strangers
    assert run.results[0]["intruder"] == "a stranger's key"  # the job itself received the stranger's key


def _can_unshare() -> str | None:
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "needs unshare and ip (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot make a network namespace here: {probe.stderr.strip()}"


INSIDE = """
import sys
from helpers import launch
run = launch(sys.argv[1], nproc=2, args=["--port-file", sys.argv[2], "--wait", 1, "--hold-until", sys.argv[3]],
             echo=False, timeout=120)
print("job finished; intruder:", run.results[0]["intruder"])
"""


@pytest.mark.skipif(_can_unshare() is not None, reason=str(_can_unshare()))
def test_the_same_job_in_its_own_network_namespace_runs_and_cannot_be_reached(tmp_path):
    port_file, tried = tmp_path / "port", tmp_path / "stranger_tried"
    inside = subprocess.Popen(["unshare", "--net", "sh", "-c", 'ip link set lo up && exec "$0" -c "$1" "$2" "$3" "$4"',
                               sys.executable, INSIDE, str(NEIGHBOUR), str(port_file), str(tried)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    seen = _stranger(_port(port_file), patience=2)  # while the job holds on, waiting for `tried`
    tried.touch()
    out, err = inside.communicate(timeout=180)
    assert seen.startswith("unreachable:"), seen  # catches a namespace that still shares the host's loopback
    assert inside.returncode == 0, err[-2000:]  # loopback inside the namespace is all the job needs
    assert "job finished; intruder: None" in out, out
