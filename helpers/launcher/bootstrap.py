"""The first code every worker runs, before the learner's script: used by the launcher only.

It ties the worker's life to its agent (so no worker outlives a dead launcher), makes output
line-buffered (so the notebook sees it live), lets the launcher ask for its Python stacks (a hang
becomes a diagnosis), tells the launcher which global rank this process is, records a precise
failure time and traceback if the script raises, then runs the script as ``__main__`` exactly as
``python script.py`` would. Standard library only (and helpers.kit.run_files), but for two imports of torch: its
``record`` and, in :func:`run_script`, a module that must come before the script's process group.

Fresh-interpreter mode runs ``python -u -m helpers.launcher.bootstrap script.py args...``; fork mode calls
:func:`run_forked_script` in a process forked from the agent (itself forked from the preloaded launch server).
"""
from __future__ import annotations

import ctypes
import faulthandler
import os
import runpy
import signal
import sys
import time
import traceback

from helpers.kit import run_files

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _answer_stack_requests(run_dir: str, me: dict) -> None:
    """On STACK_SIGNAL, append every thread's Python stack to this rank's stacks file. faulthandler
    writes from a C signal handler, so it answers even while the script waits inside a collective."""
    path = run_files.rank_file(run_dir, "stacks", me["rank"], me["attempt"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    faulthandler.register(run_files.STACK_SIGNAL, file=open(path, "w"), all_threads=True, chain=False)


def _wait_until_every_rank_is_forked(run_dir: str, me: dict, local_world_size: int, limit: float = 10.0) -> None:
    """Fork mode: start the script only once every worker of this agent's attempt has been forked.

    The agent forks its workers one after another while its TCPStore server thread already serves the
    ranks forked first. A fork copies a lock held by another thread in its held state: we caught a
    worker stuck for good in glibc's resolver lock (``__resolv_context_get`` under ``getnameinfo``,
    from c10d's ``formatSockAddr`` in ``TCPStore::TCPStore``), taken by the agent's store thread while
    it formatted an earlier rank's connection. Once no rank talks to the store before the last fork,
    the agent's other threads hold no lock at fork time. The hazard is per agent, so each rank waits for
    its own node's ranks only (counting the whole job's ranks made every rank of a two-node demo wait out
    the limit, 10 s, since each node's agent has its own run folder)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if run_files.registered_count(run_dir, me["attempt"], me["node"]) >= local_world_size:
            return
        time.sleep(0.002)


def run_forked_script(script: str, *args: str) -> None:
    """The entry point of a worker forked from the agent (fork mode)."""
    run_script(script, *args, forked=True)


def run_script(script: str, *args: str, forked: bool = False) -> None:
    die_with_parent()
    # Before the script's own init_process_group: a script that builds DDP after it would otherwise keep its group
    # alive into interpreter shutdown, where gloo's threads can abort the process (see helpers/kit/distributed.py).
    # Fresh-interpreter mode imports torch here anyway (torch's record, below); fork mode has it preloaded.
    import torch.distributed.nn.functional  # noqa: F401
    # A forked worker inherits the agent's Python signal handlers; give it a fresh interpreter's.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    # In fork mode torch was imported before these variables were set; apply them as a fresh
    # interpreter would (torch/distributed/__init__.py reads TORCH_DISTRIBUTED_DEBUG once, at import).
    if "torch" in sys.modules and "OMP_NUM_THREADS" in os.environ:
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if "torch.distributed" in sys.modules:
        sys.modules["torch.distributed"].set_debug_level_from_env()
    # A rank killed by a C++ abort (gloo's size checks) or a segfault has no Python traceback: faulthandler writes
    # every thread's Python stack to its log instead, so the launcher can name the learner's line.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    run_dir = os.environ.get("HELPERS_RUN_DIR")
    me = run_files.identity()
    if run_dir:
        _answer_stack_requests(run_dir, me)  # before registering: the launcher signals registered pids
        run_files.write_json(run_files.rank_file(run_dir, "workers", me["rank"], me["attempt"]),
                               {**me, "started": time.time()})
        if forked:
            _wait_until_every_rank_is_forked(run_dir, me, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0) and run_dir:
            _record_failure(run_dir, me, f"SystemExit: {stop.code}\n")
        raise
    except BaseException:
        if run_dir:
            _record_failure(run_dir, me, traceback.format_exc())
        if forked:  # a fresh interpreter prints the traceback as it exits; a forked worker's ends in torch's error
            traceback.print_exc()  # file, so print it: the rank's log then holds it, as a terminal would show it
            sys.stderr.flush()
        raise


def _record_failure(run_dir: str, me: dict, text: str) -> None:
    run_files.write_json(run_files.rank_file(run_dir, "failures", me["rank"], me["attempt"]),
                           {**me, "time": time.time(), "traceback": text})


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(run_script)(*sys.argv[1:])
