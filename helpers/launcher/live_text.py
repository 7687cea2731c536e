"""What live ranks tell the learner (helpers/launcher/live.py): their errors, and the pure rules behind the messages
(which ranks a cell names, a rank's value, a failed cell, a broken process group, a dead rank's stack). No processes
here: tests/fast/test_live_ranks_protocol.py tests each rule.
"""
from __future__ import annotations

import linecache
import os
import pickle
import re
from typing import Any

from helpers.launcher import diagnosis
from helpers.launcher.api import _LIBRARY_DIRS, WorkerFailed, _ShortTraceback

RESTART = "%ranks restart starts the ranks again (their variables are lost)."


class RanksUnavailable(_ShortTraceback, RuntimeError):
    """No cell can run now: no ranks were started, they are gone, or their process group is broken."""


class CellFailed(WorkerFailed):
    """A cell raised on one or more ranks; the ranks are alive and keep their variables. `.rank`, `.where`, `.error`:
    the first rank that raised, its cell line ("In[7]:3 (in <module>)") and its error; `.tracebacks[rank]`."""

    def __init__(self, message: str, failed: dict[int, dict]) -> None:
        first = min(failed)
        super().__init__(message, rank=first, where=failed[first].get("where"), error=failed[first].get("error"))
        self.tracebacks = {rank: reply.get("traceback", "") for rank, reply in failed.items()}


class CellInterrupted(_ShortTraceback, KeyboardInterrupt):
    """■ Stop during a cell. `.where[rank]`: where each rank running the cell was; `.stuck`: the ranks that could not
    be interrupted (then the process group is broken: %ranks restart)."""

    def __init__(self, message: str, where: dict[int, str], stuck: set[int]) -> None:
        super().__init__(message)
        self.where, self.stuck = where, stuck


class CellTimeout(_ShortTraceback, TimeoutError):
    """The cell ran past --timeout; what happened next is as for CellInterrupted (`.where`, `.stuck`)."""

    def __init__(self, message: str, where: dict[int, str], stuck: set[int]) -> None:
        super().__init__(message)
        self.where, self.stuck = where, stuck


class RemoteRepr:
    """A value that could not travel to the notebook (it does not pickle, or not here): its repr on the rank."""

    def __init__(self, text: str, why: str) -> None:
        self.text, self.why = text, why

    def __repr__(self) -> str:
        return self.text


def parse_ranks(text: str | None, world_size: int) -> list[int]:
    """'1', '0,2', '0-2', '0 3' or 'all' (or nothing) -> sorted ranks, each checked against the world size."""
    words = [word for word in re.split(r"[,\s]+", (text or "").strip()) if word]
    if not words or words == ["all"]:
        return list(range(world_size))
    chosen = set()
    for word in words:
        found = re.fullmatch(r"(\d+)(?:-(\d+))?", word)
        if not found:
            raise ValueError(f"%%ranks: {word!r} is not a rank; write ranks as 1, 0,2 or 0-3 (default: all)")
        low, high = int(found[1]), int(found[2] or found[1])
        if high >= world_size or low > high:
            raise ValueError(f"%%ranks: no rank {word} in a group of {world_size} (ranks 0-{world_size - 1})")
        chosen.update(range(low, high + 1))
    return sorted(chosen)


def unpack(header: dict[str, Any], blob: bytes) -> Any:
    """A rank's value: unpickled, or its repr (RemoteRepr) when it cannot be unpickled here."""
    kind = header.get("value")
    if kind is None:
        return None
    if kind == "pickle":
        try:
            return pickle.loads(blob)
        except Exception as error:
            return RemoteRepr(header.get("repr", "?"), f"{type(error).__name__}: {error}")
    return RemoteRepr(header.get("repr", "?"), header.get("why", ""))


def failure_message(failed: dict[int, dict], others: dict[int, str]) -> str:
    """The error of a cell that raised on the ranks in `failed` (their replies); `others`: what each other rank did."""
    lines = [f"rank {rank} failed at {reply.get('where') or 'an unknown line'}: {reply.get('error')}"
             for rank, reply in sorted(failed.items())]
    lines += [f"rank {rank} {what}" for rank, what in sorted(others.items())]
    lines.append("Every rank keeps its variables; the ranks are ready for the next cell.")
    shown: dict[str, int] = {}
    for rank, reply in sorted(failed.items()):
        text = reply.get("traceback", "").rstrip()
        if text in shown:
            lines.append(f"--- rank {rank}: the same traceback as rank {shown[text]} ---")
        else:
            shown[text] = rank
            lines += [f"--- traceback from rank {rank} ---", text]
    return "\n".join(lines)


def broken_message(stuck_where: dict[int, str]) -> str:
    ranks = ", ".join(str(rank) for rank in sorted(stuck_where))
    places = "".join(f"\n  rank {rank}: {where}" for rank, where in sorted(stuck_where.items()))
    return (f"The process group is broken: rank{'s' if len(stuck_where) > 1 else ''} {ranks} did not stop.{places}\n"
            f"A rank waits inside C++ (in gloo's wait; an nccl collective returns once queued, and a later GPU sync "
            f"waits instead), where Python cannot interrupt it, and the other ranks can no longer match its "
            f"collectives. {RESTART}")


def cell_stack(log_text: str, read_line=linecache.getline) -> str | None:
    """The Python stack of a rank that died from a signal (faulthandler's last dump in its log), cut to the cells'
    frames and what they called, outermost first as in a traceback; None when no cell frame is in it."""
    fatal = log_text.rfind("Fatal Python error:")
    if fatal < 0:
        return None
    for frames in diagnosis.parse_stacks(log_text[fatal:]):
        cells = [index for index, (file, _, _) in enumerate(frames) if file.startswith("In[")]
        if not cells:
            continue
        lines = []
        for file, line, func in reversed(frames[:cells[-1] + 1]):
            shown = next((os.path.relpath(file, base) for base in _LIBRARY_DIRS if file.startswith(base + os.sep)),
                         file)
            lines.append(f'  File "{shown}", line {line}, in {func}')
            source = read_line(file, line).strip() if file.startswith("In[") else ""
            if source:
                lines.append(f"    {source}")
        lines.append(log_text[fatal:].splitlines()[0])
        return "\n".join(lines)
    return None


def death_message(failure: WorkerFailed) -> str:
    """api.wait's diagnosis of a dead rank, with the Python stack cut to the cells when a signal killed it (the
    launcher's and torch's frames below a cell are 40 lines a learner need not read)."""
    text = str(failure)
    logs = failure.run.logs if failure.run is not None else {}
    stack = cell_stack(logs.get(failure.rank, "")) if failure.rank is not None else None
    if stack is None or "\n--- last lines of output" not in text:
        return f"{text}\n{RESTART}"
    head, _, rest = text.partition("\n--- last lines of output")
    folder = rest[rest.find("\n--- logs of every rank"):]
    title = f"--- Python stack of rank {failure.rank} when it died (faulthandler) ---"
    return f"{head}\n{title}\n{stack}{folder}\n{RESTART}"


def per_rank(values: dict[int, Any], world_size: int, keep_none: bool = False) -> Any:
    """The cell's value on each rank: a list indexed by rank when every rank ran the cell, else {rank: value};
    None when no rank had a value (unless keep_none)."""
    if not keep_none and all(value is None for value in values.values()):
        return None
    if sorted(values) == list(range(world_size)):
        return [values[rank] for rank in range(world_size)]
    return dict(sorted(values.items()))
