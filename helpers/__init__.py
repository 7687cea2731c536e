"""Helpers for the lessons: launch real torchrun workers from a notebook, report back, plot.

    from helpers import launch, WorkerFailed
    run = launch("../helpers/workers/allreduce_demo.py", nproc=2)

    %load_ext helpers          # then a cell starting with  %%torchrun -n 2

Importing this package is cheap, and the launcher is imported only when one of its names is first
used: a worker that runs ``from helpers.worker import result`` pays for nothing else.
"""
from __future__ import annotations

import importlib
import sys
import types

__all__ = ["LaunchInterrupted", "LaunchTimeout", "Run", "WorkerFailed", "free_port", "launch",
           "load_ipython_extension", "start", "wait"]
_LAUNCHER_NAMES = set(__all__) - {"load_ipython_extension"}


def __getattr__(name: str):
    if name not in _LAUNCHER_NAMES:
        raise AttributeError(f"module 'helpers' has no attribute {name!r}")
    launcher = importlib.import_module("helpers.launch")
    for public in _LAUNCHER_NAMES:
        globals()[public] = getattr(launcher, public)
    return globals()[name]


class _Package(types.ModuleType):
    def __setattr__(self, name: str, value) -> None:
        # Importing the submodule helpers.launch would rebind `helpers.launch` to the module;
        # the package promises the function (`from helpers import launch`).
        if name == "launch" and isinstance(value, types.ModuleType):
            value = value.launch
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def load_ipython_extension(ipython) -> None:
    """`%load_ext helpers` registers the %%torchrun cell magic."""
    from helpers.magic import register

    register(ipython)
