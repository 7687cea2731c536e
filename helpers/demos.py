"""Small demonstrations the lessons run in the notebook kernel itself (not in workers)."""
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
    forwards into the cell as a separate wall of text). We send fd 2 to a file for the call and keep
    its last line."""
    __tracebackhide__ = True
    import torch.multiprocessing as mp

    # spawn logs "Terminating process <pid>" while cleaning up; the short error below says it all
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryFile(mode="w+") as capture:
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            mp.spawn(function, args=args, nprocs=nprocs, join=True)
        except Exception as error:
            os.dup2(saved, 2)
            capture.seek(0)
            lines = [line for line in capture.read().splitlines() if line.strip()]
            child = lines[-1] if lines else "(no message)"
            code = getattr(error, "exit_code", "?")
            # from None: the chained ProcessExitedException would repeat torch's frames; its type and
            # message are in this one
            raise RuntimeError(f"mp.spawn raised {type(error).__name__} (a child exited with code {code}); "
                               f"the child's stderr said: {child}") from None
        finally:
            os.dup2(saved, 2)
            os.close(saved)
