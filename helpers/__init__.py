"""Helpers for the lessons: launch real torchrun workers from a notebook, report back, plot.

    from helpers import launch, WorkerFailed
    run = launch("../helpers/workers/allreduce_demo.py", nproc=2)

    %load_ext helpers          # then a cell starting with  %%torchrun -n 2
    %ranks start -n 2          # live ranks: then cells starting with  %%ranks  run on every rank, and keep state

Where each audience's code lives (helpers/README.md has the full map):
    helpers/kit/        what a worker may import: reporting, distributed, models, data, tensors, ...
    helpers/lessons/    what the notebooks import: one module per lesson, plus checks, plots, explorers
    helpers/launcher/   the machinery behind launch(); its public surface is helpers.launcher.api
    helpers/workers/    the scripts torchrun runs; they import only the kit
    helpers/tools/      teachers' and maintainers' commands (python -m helpers.tools.NAME)

Importing this package is cheap, and the launcher is imported only when one of its names is first
used: a worker that runs ``from helpers.kit.reporting import result`` pays for nothing else.
"""
from __future__ import annotations

import importlib

from helpers.kit import REPO_ROOT, WORKERS

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
    """`%load_ext helpers` registers the %%torchrun cell magic and the %ranks / %%ranks magics (live ranks)."""
    from helpers.launcher.magic import register

    register(ipython)
