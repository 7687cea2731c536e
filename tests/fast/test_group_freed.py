"""A worker's process group dies with its model, before the interpreter shuts down (helpers/kit/distributed.py).

DistributedDataParallel's constructor imports torch.distributed.nn.functional, whose collectives take
`group=group.WORLD` as a default argument: imported after init_process_group, those defaults keep the group
alive after destroy_process_group(), and gloo's threads with it, into interpreter shutdown. There they
aborted about 1 run in 10 of the Slurm test's 2-rank job ("terminate called without an active exception").
Each case runs in a fresh interpreter (the import order is the point) as a group of one on gloo, and counts
gloo's own threads (by the names gloo gives them) once the function that built DDP has returned."""
from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import os, sys, time
import torch
import torch.distributed as dist
if sys.argv[1] == "kit":
    from helpers.kit.distributed import init_distributed
    init_distributed("gloo")
else:  # the control: the same group, joined without the helper's early import
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from torch.nn.parallel import DistributedDataParallel as DDP

def train():
    model = DDP(torch.nn.Linear(4, 4))
    model(torch.ones(2, 4)).sum().backward()
    dist.destroy_process_group()

def gloo_threads():  # gloo names its threads: gloo_tcp_loop, pt_gloo_runloop (other pools may come and go)
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{task}/comm").read().strip())
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return sum("gloo" in name for name in names)

def settle(done, seconds=5):  # a busy machine: gloo's threads name themselves once they run, and one that is
    deadline = time.monotonic() + seconds  # ending can still be listed for a moment; wait up to 5 s either way
    while not done(gloo_threads()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return gloo_threads()

during = settle(lambda n: n > 0)
train()
print(during, settle(lambda n: n == 0))
"""


def _threads(how: str, tmp_path, through_bootstrap: bool = False) -> tuple[int, int]:
    script = tmp_path / "worker.py"
    script.write_text(SCRIPT)
    start = [sys.executable, "-m", "helpers.launcher.bootstrap"] if through_bootstrap else [sys.executable]
    out = subprocess.run([*start, str(script), how], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    during, after = map(int, out.stdout.split())
    assert during > 0, f"gloo started no named thread ({how}): this test cannot see the group"
    return during, after


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_the_group_and_its_threads_are_gone_once_the_model_is(tmp_path):
    with_kit = _threads("kit", tmp_path)
    control = _threads("plain", tmp_path)
    # catches an early import that was removed or moved after init_process_group: the control shows that the
    # group then outlives the model (gloo's threads still running), so this test can tell the two apart
    assert control[1] > 0, f"the control's group was freed too ({control}): the test shows nothing"
    assert with_kit[1] == 0, f"gloo's threads outlived the model and the group: {with_kit}"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_a_learners_script_started_by_the_launcher_frees_its_group_too(tmp_path):
    """The launcher's fresh-interpreter bootstrap imports the module first: a learner's own script that calls
    init_process_group itself (the control above, whose group outlives its model under plain python)."""
    during, after = _threads("plain", tmp_path, through_bootstrap=True)
    assert after == 0, f"gloo's threads outlived the model under the bootstrap: {(during, after)}"
