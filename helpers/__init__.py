"""Helpers for the lessons: launch real torchrun workers from a notebook, report back, plot.

    from helpers import launch, WorkerFailed
    run = launch("../helpers/workers/allreduce_demo.py", nproc=2)

    %load_ext helpers          # then a cell starting with  %%torchrun -n 2

Importing this package is cheap: torch is imported by the workers and the launch server, not here.
"""
from helpers.launch import LaunchTimeout, Run, WorkerFailed, free_port, launch, start, wait

__all__ = ["LaunchTimeout", "Run", "WorkerFailed", "free_port", "launch", "load_ipython_extension", "start", "wait"]


def load_ipython_extension(ipython) -> None:
    """`%load_ext helpers` registers the %%torchrun cell magic."""
    from helpers.magic import register

    register(ipython)
