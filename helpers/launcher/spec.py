"""What a launch asks for, checked, and turned into a spec: everything an agent needs, as plain JSON.

The spec may travel to a fresh interpreter (``python -m helpers.launcher.agent spec.json``), so it holds only
strings, numbers and lists: the script and its arguments, torchrun's options, the run folder, and the
workers' environment.
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from helpers.launcher import run_folder
from helpers.launcher.processes import child_env
from helpers.launcher.run_folder import short_path

# Python-side names of the torchrun options that pass through (see `torchrun --help`).
TORCHRUN_OPTIONS = {
    "nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "rdzv_conf",
    "master_addr", "master_port", "local_addr", "role", "start_method", "monitor_interval",
}


def check_arguments(script: str | os.PathLike, nproc: int, timeout: float | None,
                     max_restarts: int, options: dict) -> Path:
    """The script's absolute path; a clear error at once, before any process starts, for a bad argument."""
    if os.name != "posix":
        raise OSError("helpers.launch runs on Linux and macOS only (it needs POSIX process groups and "
                      "signals); on Windows, run the lessons inside WSL2")
    if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"nproc must be a whole number >= 1 (processes per node), got {nproc!r}")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}")
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number >= 0, got {max_restarts!r}")
    unknown = sorted(set(options) - TORCHRUN_OPTIONS)
    if unknown:
        raise TypeError(f"unknown launch option(s) {', '.join(unknown)}; torchrun options that pass "
                        f"through are: {', '.join(sorted(TORCHRUN_OPTIONS))}")
    path = Path(script)
    if not path.is_file():
        raise FileNotFoundError(f"worker script not found: {script} (looked in {short_path(Path.cwd())})")
    return path.resolve()


def new_run_dir(script: Path, log_dir: str | os.PathLike | None) -> Path:
    if log_dir is not None:
        folder = Path(log_dir)
    else:
        base = Path(os.environ.get("HELPERS_RUNS_DIR", "runs"))
        folder = base / f"{time.strftime('%Y%m%d-%H%M%S')}-{script.stem}-{uuid.uuid4().hex[:4]}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder.resolve()


def torchrun_argv(options: dict) -> list[str]:
    options = dict(options)
    if "rdzv_endpoint" not in options and options.get("rdzv_backend", "c10d") == "c10d":
        # like --standalone, but on loopback: port 0 lets the OS pick a free port
        options.setdefault("rdzv_backend", "c10d")
        options["rdzv_endpoint"] = "127.0.0.1:0"
        options.setdefault("rdzv_id", uuid.uuid4().hex)
    options.setdefault("local_addr", "127.0.0.1")
    return [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]


def worker_env(run_dir: Path, node: int, nproc: int, debug: bool = False) -> dict[str, str]:
    """The workers' environment: the kernel's, plus the run folder, threads per worker, debug switches."""
    env = child_env()
    env["HELPERS_RUN_DIR"], env["HELPERS_NODE"] = str(run_dir), str(node)
    if "OMP_NUM_THREADS" not in os.environ and os.environ.get("LESSONS_CPUS", "").strip():
        # a workshop budget: this learner's CPUs, shared by the workers of this node
        env["OMP_NUM_THREADS"] = str(max(1, int(os.environ["LESSONS_CPUS"]) // nproc))
    elif nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # what torchrun does: no oversubscription
    if debug:
        env["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    return env


def build_spec(script: Path, nproc: int, args: tuple, max_restarts: int, options: dict,
               run_dir: Path, fresh: bool, stop_grace: int = 2, debug: bool = False) -> dict:
    """Everything an agent needs, as plain JSON (it may travel to a fresh interpreter)."""
    node = int(options.get("node_rank", 0))
    return {"script": str(script), "args": [str(a) for a in args], "nproc": nproc,
            "max_restarts": max_restarts, "torchrun_argv": torchrun_argv(options),
            "run_dir": str(run_dir), "node_rank": node,
            "elastic_log_dir": run_folder.node_file(run_dir, "elastic", node),
            "fresh": fresh, "stop_grace": stop_grace, "monitor_interval": 0.05,
            "env": worker_env(run_dir, node, nproc, debug), "cwd": os.getcwd()}
