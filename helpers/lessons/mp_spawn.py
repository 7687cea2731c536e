"""The source article's `mp.spawn` run from a notebook, and why it fails there (lessons 00 and 02, appendix A0)."""
from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable


def mp_spawn_from_notebook(function: Callable, nprocs: int = 2, args: tuple = ()) -> None:
    """Run the source article's ``mp.spawn(function, ...)`` and, when it fails, raise a short error
    that names what mp.spawn raised and adds the child's own last error line.

    A child that dies before torch's ``_wrap`` runs leaves no error file, so mp.spawn's exception says
    only "terminated with exit code 1"; the child's reason is on its stderr (fd 2, which ipykernel
    forwards into the cell as a separate wall of text, the children's lines interleaved). So each child
    starts through a two-line shell script that sends its stderr to a file of its own
    (``multiprocessing.set_executable``, which the spawn start method uses for every child), and the
    error keeps the last line the children wrote (they all fail alike; the first in sorted order, so the
    message does not depend on which child was faster)."""
    __tracebackhide__ = True
    import multiprocessing.spawn
    import sys

    import torch.multiprocessing as mp

    from helpers.launcher.api import stop_launch_server

    stop_launch_server(before="the spawned interpreter")
    # spawn logs "Terminating process <pid>" while cleaning up; the short error below says it all
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as folder:
        starter = os.path.join(folder, "python-with-own-stderr")
        with open(starter, "w") as file:
            file.write(f'#!/bin/sh\nexec "{sys.executable}" "$@" 2>"{folder}/stderr-$$.txt"\n')
        os.chmod(starter, 0o755)
        executable = multiprocessing.spawn.get_executable()
        multiprocessing.spawn.set_executable(starter)
        try:
            mp.spawn(function, args=args, nprocs=nprocs, join=True)
        except Exception as error:
            said = []
            for name in sorted(os.listdir(folder)):
                if name.startswith("stderr-"):
                    with open(os.path.join(folder, name)) as file:
                        lines = [line for line in file.read().splitlines() if line.strip()]
                    if lines:
                        said.append(lines[-1])
            child = sorted(said)[0] if said else "(no message)"
            code = getattr(error, "exit_code", "?")
            # from None: the chained ProcessExitedException would repeat torch's frames; its type and
            # message are in this one
            raise RuntimeError(f"mp.spawn raised {type(error).__name__} (a child exited with code {code}); "
                               f"the child's stderr said: {child}") from None
        finally:
            multiprocessing.spawn.set_executable(executable)
