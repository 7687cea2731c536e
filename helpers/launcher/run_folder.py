"""The launcher's side of the run folder: reading back what a launch's workers and agents wrote.

The file names are the workers' protocol and live in helpers/kit/run_files.py (standard library only, since every
worker imports it); this module, imported only by the launcher, gathers the files into lines, results and
registrations, and may use psutil.
"""
from __future__ import annotations

import json
import os
import re
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

from helpers.kit import REPO_ROOT
from helpers.kit.run_files import STACK_SIGNAL, node_file, rank_file, rank_files, rank_log, read_json, write_json

__all__ = ["AGENT_DIED", "AGENT_ERROR", "AGENT_OK", "AGENT_WORKERS_FAILED", "STACK_SIGNAL", "NodeFolder", "Tail",
           "alive", "node_file", "rank_file", "rank_log", "read_json", "registered_pids", "registered_processes",
           "short_path", "tracebacks", "write_json"]

# The agent's exit codes (helpers/launcher/agent.py); a negative code is the signal that killed it.
AGENT_OK, AGENT_WORKERS_FAILED, AGENT_ERROR, AGENT_DIED = 0, 1, 2, 3

_TORCHRUN_LOG = re.compile(r"attempt_(\d+)[/\\](\d+)[/\\](stdout|stderr)\.log$")


def short_path(path: str | os.PathLike) -> Path:
    """`path` relative to the working directory or the repository: no machine paths in outputs."""
    path = Path(os.path.abspath(path))
    for base in (Path.cwd(), REPO_ROOT):
        try:
            return path.relative_to(base)
        except ValueError:
            continue
    return Path(os.path.relpath(path))


def registered_pids(run_dir: str | os.PathLike) -> list[int]:
    """The pid of every worker the run registered, any rank and attempt (for checks that nothing is left)."""
    return [read_json(path)["pid"] for path in rank_files(run_dir, "workers")]


def registered_processes(run_dir: str | os.PathLike) -> set[int]:
    """Every worker the run registered and each one's parent (its agent): the processes it is known to have used."""
    records = [read_json(path) for path in rank_files(run_dir, "workers")]
    return {record["pid"] for record in records} | {record["parent"] for record in records if "parent" in record}


def tracebacks(run_dir: str | os.PathLike) -> dict[int, str]:
    """Every rank's own traceback, as its bootstrap recorded it (the last attempt of each rank wins)."""
    found = {}
    for path in rank_files(run_dir, "failures"):
        record = read_json(path)
        found[int(record["rank"])] = record["traceback"]
    return found


def alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


class Tail:
    """New complete lines appended to one file since the last read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        return [line.decode("utf-8", "replace") for line in lines]


class NodeFolder:
    """What one node's workers have written so far: gathered from the run folder, nothing printed.

    `collect()` returns the new complete lines as (rank, stream, line) and appends them to each rank's log
    (run_files.rank_log).
    """

    def __init__(self, run_dir: str | os.PathLike, node: int, nproc: int) -> None:
        self.run_dir, self.node, self.nproc = Path(run_dir), node, nproc
        self.workers: dict[tuple[int, int], dict] = {}  # (rank, attempt) -> registration
        self.lines: dict[int, list[str]] = defaultdict(list)
        self.metrics: list[dict[str, Any]] = []
        self.results: dict[int, dict[str, Any]] = defaultdict(dict)
        self.progress: dict[int, tuple[int, int]] = {}
        self._tails: dict[str, Tail] = {}
        self._attempt_seen: dict[int, int] = {}
        self._rank_logs: dict[int, Any] = {}
        self.ended = time.time()

    def collect(self, final: bool = False) -> list[tuple[int, str, str]]:
        for path in rank_files(self.run_dir, "workers"):
            info = read_json(path)
            if info and info["node"] == self.node:
                self.workers.setdefault((info["rank"], info["attempt"]), info)
        new: list[tuple[int, str, str]] = []
        for path in sorted(Path(node_file(self.run_dir, "elastic", self.node)).glob("*/attempt_*/*/std*.log")):
            new += self._read_log(str(path), final)
        for rank, attempt in list(self.workers):
            for line in self._tail(rank_file(self.run_dir, "events", rank, attempt)).read():
                self._take_event(json.loads(line))
        if final:
            self.close()
        return new

    def close(self) -> None:
        self.ended = time.time()
        for handle in self._rank_logs.values():
            handle.close()
        self._rank_logs.clear()

    def _tail(self, path: str) -> Tail:
        return self._tails.setdefault(path, Tail(path))

    def _read_log(self, path: str, final: bool) -> list[tuple[int, str, str]]:
        match = _TORCHRUN_LOG.search(path)
        if not match:
            return []
        attempt, local_rank, stream = int(match[1]), int(match[2]), match[3]
        infos = [info for (_, a), info in self.workers.items() if a == attempt and info["local_rank"] == local_rank]
        if not infos and not final:
            return []  # not registered yet: read it next time, when its global rank is known
        rank = infos[0]["rank"] if infos else self.node * self.nproc + local_rank
        new = []
        for line in self._tail(path).read(final):
            if self._attempt_seen.setdefault(rank, attempt) != attempt:
                self._attempt_seen[rank] = attempt
                new.append(self._add_line(rank, "stdout", f"----- restart: attempt {attempt} -----"))
            new.append(self._add_line(rank, stream, line))
        return new

    def _add_line(self, rank: int, stream: str, line: str) -> tuple[int, str, str]:
        self.lines[rank].append(line)
        if rank not in self._rank_logs:
            self._rank_logs[rank] = open(rank_log(self.run_dir, rank), "a", buffering=1)
        self._rank_logs[rank].write(line + "\n")
        return rank, stream, line

    def _take_event(self, event: dict) -> None:
        kind, rank = event.pop("kind"), event["rank"]
        if kind == "metric":
            self.metrics.append(event)
        elif kind == "progress":
            self.progress[rank] = (event["done"], event["total"])
        elif kind == "result":
            self.results[rank].update(event["values"])

    # -- questions the launcher asks
    def logs_text(self) -> dict[int, str]:
        return {rank: "\n".join(lines) + "\n" for rank, lines in sorted(self.lines.items())}

    def attempts(self) -> int:
        return 1 + max((attempt for _, attempt in self.workers), default=0)

    def last_attempt(self) -> dict[int, dict]:
        """Registrations of the last attempt, by rank."""
        last = self.attempts() - 1
        return {rank: info for (rank, attempt), info in self.workers.items() if attempt == last}

    def failure_records(self) -> dict[int, dict]:
        """Exceptions the workers of the last attempt recorded, by rank."""
        last = self.attempts() - 1
        records = {rank: read_json(rank_file(self.run_dir, "failures", rank, last)) for rank in self.last_attempt()}
        return {rank: record for rank, record in records.items() if record}

    def agent_outcome(self) -> dict:
        return read_json(node_file(self.run_dir, "agent_result", self.node), {})

    def live_worker_pids(self) -> dict[int, int]:
        """rank -> pid of every registered worker (any attempt) still running."""
        return {rank: info["pid"] for (rank, _), info in sorted(self.workers.items()) if alive(info["pid"])}

    def timings(self, started_wall: float) -> dict[str, float]:
        starts = [info["started"] for info in self.workers.values()]
        first = min(starts) if starts else self.ended
        return {"until_workers_run": round(first - started_wall, 4),
                "workers_running": round(self.ended - first, 4)}

    def stack_sizes(self) -> dict[int, int]:
        """Bytes in each live rank's stacks file now (a dump appends to it)."""
        sizes = {}
        for rank, info in self.last_attempt().items():
            try:
                sizes[rank] = os.path.getsize(rank_file(self.run_dir, "stacks", rank, info["attempt"]))
            except FileNotFoundError:
                sizes[rank] = 0
        return sizes

    def stacks_since(self, sizes: dict[int, int]) -> dict[int, str]:
        """What each rank's stacks file gained after the sizes were taken."""
        out = {}
        for rank, offset in sizes.items():
            path = rank_file(self.run_dir, "stacks", rank, self.last_attempt()[rank]["attempt"])
            with open(path, "rb") as f:
                f.seek(offset)
                out[rank] = f.read().decode("utf-8", "replace")
        return out
