"""Helpers for the lessons: launch real torchrun workers from a notebook, report back, plot.

    from helpers import launch, WorkerFailed
    run = launch("../helpers/workers/allreduce_demo.py", nproc=2)

    %load_ext helpers          # then a cell starting with  %%torchrun -n 2

Where each audience's code lives (helpers/README.md has the full map):
    helpers/*.py        lesson libraries (one per lesson, named by topic) and the worker kit
                        (reporting, distributed, models, data, checkpoint, tensors, instruments, ...)
    helpers/workers/    the scripts torchrun runs; they import only the worker kit
    helpers/launcher/   the machinery behind launch(); learners never need to open it
    helpers/tools/      teachers' and maintainers' commands (python -m helpers.tools.NAME)

Importing this package is cheap, and the launcher is imported only when one of its names is first
used: a worker that runs ``from helpers.reporting import result`` pays for nothing else.
"""
from __future__ import annotations

import importlib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
WORKERS = REPO_ROOT / "helpers" / "workers"

__all__ = ["REPO_ROOT", "WORKERS", "LaunchInterrupted", "LaunchTimeout", "Run", "WorkerFailed", "free_port", "launch",
           "load_ipython_extension", "start", "wait"]
_LAUNCHER_NAMES = {"LaunchInterrupted", "LaunchTimeout", "Run", "WorkerFailed", "free_port", "launch", "start", "wait"}


def __getattr__(name: str):
    if name not in _LAUNCHER_NAMES:
        raise AttributeError(f"module 'helpers' has no attribute {name!r}")
    api = importlib.import_module("helpers.launcher.api")
    for public in _LAUNCHER_NAMES:
        globals()[public] = getattr(api, public)
    return globals()[name]


def load_ipython_extension(ipython) -> None:
    """`%load_ext helpers` registers the %%torchrun cell magic."""
    from helpers.launcher.magic import register

    register(ipython)
