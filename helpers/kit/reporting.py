"""Worker side: report metrics, progress and results back to the notebook that launched you.

    from helpers.kit.reporting import report, progress, result
    report(step=i, loss=loss.item())      # one row of run.metrics
    progress(i + 1, total=steps)           # drives the progress bar in the notebook
    result(checksum=3.14, order=[2, 0])    # run.results[rank]["checksum"]

Under `helpers.launch` these append JSON lines to files in the run folder. Under a plain terminal
`torchrun` (no HELPERS_RUN_DIR in the environment) every call returns at once and costs nothing.
This module imports neither torch nor the launcher: only the standard library and helpers.kit.run_files.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any

from helpers.kit import run_files

_RUN_DIR = os.environ.get("HELPERS_RUN_DIR")
_stream = None


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _plain(value: Any) -> Any:
    """Tensors and numpy values become lists/numbers so that they travel as JSON; a set becomes a sorted list, and
    anything else JSON cannot hold (a torch.dtype, a device) its text, rather than crashing the worker."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_plain(v) for v in value), key=str)
    return str(value)


def _emit(kind: str, fields: dict[str, Any]) -> None:
    global _stream
    if _RUN_DIR is None:
        return
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if _stream is None:
        path = run_files.rank_file(_RUN_DIR, "events", _rank(), attempt)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _stream = open(path, "a", buffering=1)
    record = {"kind": kind, "rank": _rank(), "attempt": attempt, "time": time.time(), **_plain(fields)}
    _stream.write(json.dumps(record) + "\n")


def report(step: int | None = None, **numbers: Any) -> None:
    """Record one row of metrics (e.g. ``report(step=3, loss=0.71)``); becomes a row of run.metrics."""
    _emit("metric", {"step": step, **numbers})


def progress(done: int, total: int) -> None:
    """Tell the notebook's progress bar that this rank has done `done` of `total` units."""
    _emit("progress", {"done": done, "total": total})


def result(**values: Any) -> None:
    """Hand values back to the notebook: ``run.results[rank][name]`` (tensors become lists)."""
    _emit("result", {"values": values})


