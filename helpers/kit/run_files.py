"""The run folder's file protocol: the names of the files a launch and its workers write, and a worker's identity.

Standard library only: workers import it (helpers.kit.reporting, and the launcher's bootstrap, which runs inside
every worker), and so does the launcher, whose readers live in helpers/launcher/run_folder.py. One folder per
launch; every per-rank file is keyed (global rank, attempt), where attempt is torchrun's restart count::

    rank{R}.log                           every line of rank R, all attempts (written by the launcher)
    elastic_node{N}/<run id>/attempt_{A}/{local rank}/std{out,err}.log    torchrun's own worker logs
    workers/rank{R}-attempt{A}.json       the bootstrap's registration: pid, parent, node, local rank, start time
    failures/rank{R}-attempt{A}.json      an uncaught exception: exact time and traceback
    events/rank{R}-attempt{A}.jsonl       helpers.kit.reporting's metrics, progress and results
    stacks/rank{R}-attempt{A}.txt         Python stacks, dumped by faulthandler on STACK_SIGNAL
    spec_node{N}.json, agent_node{N}.log, agent_result_node{N}.json       the torchrun agent of node N
"""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

# The signal that makes a worker write its Python stacks (faulthandler, installed by the bootstrap).
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)

_EXTENSIONS = {"workers": "json", "failures": "json", "events": "jsonl", "stacks": "txt"}


def rank_file(run_dir: str | os.PathLike, kind: str, rank: int, attempt: int) -> str:
    """The per-rank file of one kind: workers, failures, events or stacks."""
    return os.path.join(run_dir, kind, f"rank{rank}-attempt{attempt}.{_EXTENSIONS[kind]}")


def rank_files(run_dir: str | os.PathLike, kind: str, attempt: int | str = "*") -> list[Path]:
    """Every per-rank file of one kind written so far (of one attempt, or of all), sorted by name."""
    return sorted(Path(run_dir, kind).glob(f"rank*-attempt{attempt}.{_EXTENSIONS[kind]}"))


def stacks_folder(run_dir: str | os.PathLike) -> str:
    """Where the workers' Python stacks are dumped (one file per rank and attempt)."""
    return os.path.join(run_dir, "stacks")


def rank_log(run_dir: str | os.PathLike, rank: int | str) -> str:
    return os.path.join(run_dir, f"rank{rank}.log")


def node_file(run_dir: str | os.PathLike, kind: str, node: int) -> str:
    """The agent's files: spec (json), agent log, agent result (json), elastic (torchrun's log folder)."""
    name = {"spec": "spec_node{}.json", "agent_log": "agent_node{}.log",
            "agent_result": "agent_result_node{}.json", "elastic": "elastic_node{}"}[kind]
    return os.path.join(run_dir, name.format(node))


def write_json(path: str, data: dict) -> None:
    """Write atomically, so that a reader never sees half a file."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return default


def identity() -> dict:
    """Who this worker is, from torchrun's environment."""
    return {
        "rank": int(os.environ.get("RANK", 0)),
        "local_rank": int(os.environ.get("LOCAL_RANK", 0)),
        # the launcher's node number (GROUP_RANK may differ: c10d assigns it by arrival)
        "node": int(os.environ.get("HELPERS_NODE", os.environ.get("GROUP_RANK", 0))),
        "attempt": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0)),
        "pid": os.getpid(),
        "parent": os.getppid(),  # the agent that started this worker
    }


def registered_count(run_dir: str | os.PathLike, attempt: int, node: int) -> int:
    """How many workers of this node's agent have registered for this attempt so far (the bootstrap waits on it)."""
    return sum(read_json(path, {}).get("node") == node for path in rank_files(run_dir, "workers", attempt))
