"""What this machine offers for parallel training: cores, GPUs, backends, versions.

    from helpers.lessons.system import print_machine, usable_cores, pinned
    print_machine()            # the table each lesson opens with
    usable_cores()             # cores this process may run on (affinity and a cgroup CPU quota)
    pinned("torch")            # the version requirements.txt pins: the lessons' one source of versions

Importing it costs no torch import (the pre-flight check runs before torch is known to work).
"""
from __future__ import annotations

import os
import platform
import re
from pathlib import Path

from helpers import REPO_ROOT


def cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def machine_summary() -> dict[str, object]:
    """A dict of facts a lesson can print and assert on."""
    import torch
    import torch.distributed as dist

    usable = usable_cores()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu cores usable": usable,
        "cpu bf16 instructions": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"}) or "none",
        "GPUs": gpus or "none",
        "gloo available": dist.is_gloo_available(),
        # dist.is_nccl_available() says only that this torch build contains nccl; running it also needs a GPU
        "nccl in this torch build": dist.is_nccl_available(),
        "nccl usable here": dist.is_nccl_available() and bool(gpus),
        "mpi available": dist.is_mpi_available(),
        "backend the lessons pick": "nccl" if gpus else "gloo",
    }


def print_machine() -> dict[str, object]:
    summary = machine_summary()
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}} : {value}")
    return summary


def usable_cores() -> int:
    """Cores this process may run on, capped by a CPU quota (cgroup v2 cpu.max) where one is set."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cores


def pinned(package: str, requirements: Path = REPO_ROOT / "requirements.txt") -> str:
    """The exact version requirements.txt pins for `package` (the lessons' one source of versions)."""
    match = re.search(rf"^{re.escape(package)}==([^\s#]+)", requirements.read_text(), re.MULTILINE | re.IGNORECASE)
    if match is None:
        raise KeyError(f"{package} is not pinned in {requirements.name}")
    return match.group(1)
