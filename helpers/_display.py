"""The launcher's eyes: tails the run folder while workers run, prints labelled lines, draws progress.

Workers write only to files (torchrun's per-rank stdout/stderr logs, and helpers.worker's event
files), so a chatty worker never blocks on a pipe and nothing is lost if the notebook dies: the run
folder keeps everything. Lines are shown only once complete, so they are never torn.
"""
from __future__ import annotations

import json
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import psutil

REPO_ROOT = Path(__file__).resolve().parent.parent
_COLOURS = ["\x1b[34m", "\x1b[32m", "\x1b[35m", "\x1b[36m", "\x1b[33m", "\x1b[94m", "\x1b[92m", "\x1b[95m"]
_RED, _RESET = "\x1b[31m", "\x1b[0m"
_LOG_PATH = re.compile(r"attempt_(\d+)[/\\](\d+)[/\\](stdout|stderr)\.log$")


def short_path(path: Path) -> Path:
    """`path` relative to the working directory or the repository: no machine paths in outputs."""
    path = Path(os.path.abspath(path))
    for base in (Path.cwd(), REPO_ROOT):
        try:
            return path.relative_to(base)
        except ValueError:
            continue
    return Path(os.path.relpath(path))


class _Tail:
    """New complete lines appended to one file since the last read."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def read(self, final: bool = False) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        data = self.partial + data
        lines = data.split(b"\n")
        self.partial = lines.pop()
        if final and self.partial:
            lines, self.partial = [*lines, self.partial], b""
        return [line.decode("utf-8", "replace") for line in lines]


class LiveView:
    """Everything one agent's workers have said so far, gathered from the run folder."""

    _handle: Any = None
    _last_draw = 0.0

    def __init__(self, run_dir: Path, node: int, nproc: int, echo: bool | int) -> None:
        self.run_dir, self.node, self.nproc = run_dir, node, nproc
        self.limit = (10**12 if echo is True else int(echo)) if echo else 0
        self.shown = 0
        self.workers: dict[tuple[int, int], dict] = {}  # (local_rank, attempt) -> registration
        self.lines: dict[int, list[str]] = defaultdict(list)
        self.log_tails: dict[Path, _Tail] = {}
        self.event_tails: dict[Path, _Tail] = {}
        self.metrics: list[dict[str, Any]] = []
        self.results: dict[int, dict[str, Any]] = defaultdict(dict)
        self.progress: dict[int, tuple[int, int]] = {}
        self.seen_attempts: dict[int, int] = {}
        self.rank_logs: dict[int, Any] = {}
        self.ended = time.time()

    # -- gathering
    def collect(self, final: bool = False) -> None:
        for path in (self.run_dir / "workers").glob(f"node{self.node}-*.json"):
            info = json.loads(path.read_text())
            self.workers.setdefault((info["local_rank"], info["attempt"]), info)
        for path in sorted((self.run_dir / f"elastic_node{self.node}").glob("*/attempt_*/*/std*.log")):
            self._read_log(path, final)
        ranks = {info["rank"] for info in self.workers.values()}
        for rank in ranks:
            for path in sorted((self.run_dir / "events").glob(f"rank{rank}-attempt*.jsonl")):
                tail = self.event_tails.setdefault(path, _Tail(path))
                for line in tail.read():
                    self._take_event(json.loads(line))
        if final:
            self.ended = time.time()
            for handle in self.rank_logs.values():
                handle.close()
            self.rank_logs.clear()

    def _read_log(self, path: Path, final: bool) -> None:
        match = _LOG_PATH.search(str(path))
        if not match:
            return
        attempt, local_rank, stream = int(match[1]), int(match[2]), match[3]
        info = self.workers.get((local_rank, attempt))
        if info is None and not final:
            return  # not registered yet: read it next time, when its global rank is known
        rank = info["rank"] if info else self.node * self.nproc + local_rank
        tail = self.log_tails.setdefault(path, _Tail(path))
        new = tail.read(final)
        if not new:
            return
        if self.seen_attempts.setdefault(rank, attempt) != attempt:
            self.seen_attempts[rank] = attempt
            self._add_line(rank, f"----- restart: attempt {attempt} -----", "stdout")
        for line in new:
            self._add_line(rank, line, stream)

    def _add_line(self, rank: int, line: str, stream: str) -> None:
        self.lines[rank].append(line)
        if rank not in self.rank_logs:
            self.rank_logs[rank] = open(self.run_dir / f"rank{rank}.log", "a", buffering=1)
        self.rank_logs[rank].write(line + "\n")
        if self.shown < self.limit:
            colour = _COLOURS[rank % len(_COLOURS)]
            body = f"{_RED}{line}{_RESET}" if stream == "stderr" else line
            print(f"{colour}[rank {rank}]{_RESET} {body}", flush=False)
            self.shown += 1
            if self.shown == self.limit:
                print(f"... more output is not shown live (echo={self.limit}); every line is in "
                      f"run.logs[rank] and in {short_path(self.run_dir)}/rank<N>.log")
            sys.stdout.flush()

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

    def ranks_of_last_attempt(self) -> set[int]:
        last = self.attempts() - 1
        return {info["rank"] for (_, attempt), info in self.workers.items() if attempt == last}

    def failure_records(self) -> dict[int, dict]:
        """Exceptions the workers of the last attempt recorded, by rank."""
        last = self.attempts() - 1
        records = [json.loads(p.read_text()) for p in (self.run_dir / "failures").glob(f"node{self.node}-*.json")]
        return {info["rank"]: info for info in records if info["attempt"] == last}

    def live_worker_pids(self) -> list[int]:
        alive = []
        for info in self.workers.values():
            try:
                if psutil.Process(info["pid"]).status() != psutil.STATUS_ZOMBIE:
                    alive.append(info["pid"])
            except psutil.NoSuchProcess:
                pass
        return alive

    def timings(self, started_wall: float) -> dict[str, float]:
        starts = [info["started"] for info in self.workers.values()]
        first = min(starts) if starts else self.ended
        return {"until_workers_run": round(first - started_wall, 4),
                "workers_running": round(self.ended - first, 4)}

    # -- progress bar
    @classmethod
    def reset_progress(cls) -> None:
        cls._handle, cls._last_draw = None, 0.0

    @classmethod
    def refresh_progress(cls, views: list[LiveView], final: bool = False) -> None:
        bars = {rank: done_total for view in views for rank, done_total in view.progress.items()}
        now = time.monotonic()
        if not bars or (not final and now - cls._last_draw < 0.2):
            return
        cls._last_draw = now
        text = "\n".join(_bar(rank, done, total) for rank, (done, total) in sorted(bars.items()))
        bundle = {"text/plain": text, "text/html": f"<pre style='margin:0'>{text}</pre>"}
        try:
            from IPython import get_ipython
            from IPython.display import display
        except ImportError:
            return
        if get_ipython() is None:
            return
        if cls._handle is None:
            cls._handle = display(bundle, raw=True, display_id=True)
        else:
            cls._handle.update(bundle, raw=True)
        if final:
            cls._handle = None


def _bar(rank: int, done: int, total: int, width: int = 30) -> str:
    share = min(max(done / total, 0.0), 1.0) if total else 0.0
    filled = round(share * width)
    return f"rank {rank} |{'█' * filled}{'░' * (width - filled)}| {done}/{total}"
