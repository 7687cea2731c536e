"""What this machine offers for parallel training: cores, GPUs, backends, versions."""
from __future__ import annotations

import os
import platform
from pathlib import Path

import torch
import torch.distributed as dist


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
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu cores usable": usable,
        "cpu bf16 instructions": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"}) or "none",
        "GPUs": gpus or "none",
        "gloo available": dist.is_gloo_available(),
        "nccl available": dist.is_nccl_available() and bool(gpus),
        "mpi available": dist.is_mpi_available(),
        "default backend": "nccl" if gpus else "gloo",
    }


def print_machine() -> dict[str, object]:
    summary = machine_summary()
    width = max(map(len, summary))
    for key, value in summary.items():
        print(f"{key:<{width}} : {value}")
    return summary
