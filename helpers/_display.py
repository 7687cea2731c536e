"""The launcher's console: labelled, coloured lines of each rank, and a progress bar. It only prints.

The lines come from the run folder (helpers/_run_folder.py), complete, so they are never torn.
"""
from __future__ import annotations

import sys
import time
from typing import Any

_COLOURS = ["\x1b[34m", "\x1b[32m", "\x1b[35m", "\x1b[36m", "\x1b[33m", "\x1b[94m", "\x1b[92m", "\x1b[95m"]
_RED, _RESET = "\x1b[31m", "\x1b[0m"


class Echo:
    """Prints each rank's lines live, up to `echo` lines (True: all, False: none); `rank_logs` says
    where the rest is (e.g. runs/x/rank<N>.log)."""

    def __init__(self, echo: bool | int, rank_logs: str) -> None:
        self.limit = (10**12 if echo is True else int(echo)) if echo else 0
        self.shown, self.rank_logs = 0, rank_logs

    def show(self, lines: list[tuple[int, str, str]]) -> None:
        if self.shown >= self.limit or not lines:
            return
        for rank, stream, line in lines[:self.limit - self.shown]:
            colour = _COLOURS[rank % len(_COLOURS)]
            body = f"{_RED}{line}{_RESET}" if stream == "stderr" else line
            print(f"{colour}[rank {rank}]{_RESET} {body}")
        self.shown = min(self.limit, self.shown + len(lines))
        if self.shown == self.limit:
            print(f"... more output is not shown live (echo={self.limit}); every line is in "
                  f"run.logs[rank] and in {self.rank_logs}")
        sys.stdout.flush()


class Progress:
    """One progress bar per rank, redrawn in place in a notebook at most 5 times a second."""

    def __init__(self) -> None:
        self.handle: Any = None
        self.last_draw = 0.0

    def draw(self, bars: dict[int, tuple[int, int]], final: bool = False) -> None:
        now = time.monotonic()
        if not bars or (not final and now - self.last_draw < 0.2):
            return
        self.last_draw = now
        text = "\n".join(bar(rank, done, total) for rank, (done, total) in sorted(bars.items()))
        bundle = {"text/plain": text, "text/html": f"<pre style='margin:0'>{text}</pre>"}
        ipython = sys.modules.get("IPython")  # a notebook has imported it; a plain script never draws
        if ipython is None or ipython.get_ipython() is None:
            return
        from IPython.display import display

        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)
        if final:
            self.handle = None


def bar(rank: int, done: int, total: int, width: int = 30) -> str:
    share = min(max(done / total, 0.0), 1.0) if total else 0.0
    filled = round(share * width)
    return f"rank {rank} |{'█' * filled}{'░' * (width - filled)}| {done}/{total}"
