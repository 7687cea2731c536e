"""The first code every worker runs, before the learner's script: used by the launcher only.

It ties the worker's life to its agent (so no worker outlives a dead launcher), makes output
line-buffered (so the notebook sees it live), tells the launcher which global rank this process is,
records a precise failure time and traceback if the script raises, then runs the script as
``__main__`` exactly as ``python script.py`` would.

Fresh-interpreter mode runs ``python -u -m helpers._bootstrap script.py args...``; fork mode calls
:func:`run_script` in a process forked from the preloaded launch server.
"""
from __future__ import annotations

import ctypes
import json
import os
import runpy
import signal
import sys
import time
import traceback

PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _write_json(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _identity() -> dict:
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        # the launcher's node number (GROUP_RANK may differ: c10d assigns it by arrival)
        "node": int(os.environ.get("HELPERS_NODE", os.environ.get("GROUP_RANK", 0))),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "pid": os.getpid(),
    }


def _worker_file(run_dir: str, folder: str, me: dict) -> str:
    name = f"node{me['node']}-local{me['local_rank']}-attempt{me['attempt']}.json"
    return os.path.join(run_dir, folder, name)


def run_script(script: str, *args: str) -> None:
    die_with_parent()
    # A forked worker inherits the agent's Python signal handlers; give it a fresh interpreter's.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(line_buffering=True)
    if "torch" in sys.modules and "OMP_NUM_THREADS" in os.environ:
        # In fork mode torch was imported before this variable was set; apply it as a fresh
        # interpreter would.
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    run_dir = os.environ.get("HELPERS_RUN_DIR")
    me = _identity()
    if run_dir:
        _write_json(_worker_file(run_dir, "workers", me), {**me, "started": time.time()})
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0) and run_dir:
            _write_json(_worker_file(run_dir, "failures", me),
                        {**me, "time": time.time(), "traceback": f"SystemExit: {stop.code}\n"})
        raise
    except BaseException:
        if run_dir:
            _write_json(_worker_file(run_dir, "failures", me),
                        {**me, "time": time.time(), "traceback": traceback.format_exc()})
        raise


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(run_script)(*sys.argv[1:])
