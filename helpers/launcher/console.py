"""The launcher's console: labelled, coloured lines of each rank, and a progress bar. It only prints.

The lines come from the run folder (helpers/launcher/run_folder.py), complete, so they are never torn.
"""
from __future__ import annotations

import os
import re
import sys
import time
from typing import Any

from helpers.kit import REPO_ROOT

_COLOURS = ["\x1b[34m", "\x1b[32m", "\x1b[35m", "\x1b[36m", "\x1b[33m", "\x1b[94m", "\x1b[92m", "\x1b[95m"]
_RED, _RESET = "\x1b[31m", "\x1b[0m"


def short_frame(line: str) -> str:
    """A traceback line a rank printed, with this machine's paths shortened as the launcher's own error shortens them
    (diagnosis.clean_traceback): torch's files from ".../site-packages/", the repository's relative to its root."""
    if 'File "' not in line:
        return line
    line = re.sub(r'"/[^"]*/site-packages/', '".../site-packages/', line)
    return line.replace(f'"{REPO_ROOT}{os.sep}', '"')


class Echo:
    """Prints each rank's lines live, up to `echo` lines (True: all, False: none); `rank_logs` says
    where the rest is (e.g. runs/x/rank<N>.log)."""

    def __init__(self, echo: bool | int, rank_logs: str) -> None:
        self.limit = (10**12 if echo is True else int(echo)) if echo else 0
        self.shown, self.rank_logs, self.cut = 0, rank_logs, False

    def note(self, text: str) -> None:
        """A line from the launcher itself (not from a rank), shown only when output is echoed."""
        if self.limit:
            print(text, flush=True)

    def show(self, lines: list[tuple[int, str, str]]) -> None:
        if not self.limit or self.cut or not lines:
            return
        room = self.limit - self.shown
        for rank, stream, line in lines[:room]:
            colour = _COLOURS[rank % len(_COLOURS)]
            body = f"{_RED}{short_frame(line)}{_RESET}" if stream == "stderr" else line
            print(f"{colour}[rank {rank}]{_RESET} {body}")
        self.shown += min(room, len(lines))
        if len(lines) > room:  # said once, when the first line is left out (not when the limit is merely reached)
            self.cut = True
            print(f"... more output is not shown live (echo={self.limit}); every line is in "
                  f"run.logs[rank] and in {self.rank_logs}")
        sys.stdout.flush()


class Progress:
    """One progress bar per rank, redrawn in place in a notebook at most 5 times a second.

    In a kernel with ipywidgets, each rank gets a live IntProgress widget; the same output also carries the
    text bar (text/plain and text/html), which is what nbval compares, what a page without a widget front end
    (GitHub, nbviewer) shows, and what the stored notebook keeps. The text part is refreshed at most every
    TEXT_SECONDS and at the end; the widgets move at every draw."""

    TEXT_SECONDS = 2.0

    def __init__(self) -> None:
        self.handle: Any = None
        self.last_draw = self.last_text = 0.0
        self.widgets: dict[int, Any] | None = None
        self.ipywidgets: Any = None
        self.box: Any = None

    def draw(self, bars: dict[int, tuple[int, int]], final: bool = False) -> None:
        now = time.monotonic()
        if not bars or (not final and now - self.last_draw < 0.2):
            return
        self.last_draw = now
        ipython = sys.modules.get("IPython")  # a notebook has imported it; a plain script never draws
        if ipython is None or ipython.get_ipython() is None:
            return
        from IPython.display import display

        self._move_widgets(bars)
        if self.handle is not None and not final and now - self.last_text < self.TEXT_SECONDS:
            return
        self.last_text = now
        text = "\n".join(bar(rank, done, total) for rank, (done, total) in sorted(bars.items()))
        bundle = {"text/plain": text, "text/html": f"<pre style='margin:0'>{text}</pre>"}
        if self.box is not None:
            bundle["application/vnd.jupyter.widget-view+json"] = {
                "model_id": self.box.model_id, "version_major": 2, "version_minor": 0}
        if self.handle is None:
            self.handle = display(bundle, raw=True, display_id=True)
        else:
            self.handle.update(bundle, raw=True)
        if final:
            self.handle = None

    def _move_widgets(self, bars: dict[int, tuple[int, int]]) -> None:
        if self.widgets is None:  # the first draw: widgets if this kernel has ipywidgets
            try:
                import ipywidgets
            except ImportError:
                ipywidgets = None
            self.ipywidgets, self.widgets = ipywidgets, {}
        if self.ipywidgets is None:
            return
        added = False
        for rank, (done, total) in sorted(bars.items()):
            if rank not in self.widgets:
                self.widgets[rank] = (self.ipywidgets.IntProgress(min=0, max=1, description=f"rank {rank}"),
                                      self.ipywidgets.Label())
                added = True
            progress, label = self.widgets[rank]
            progress.max = max(total, 1)
            progress.value, label.value = min(done, progress.max), f"{done}/{total}"
        if added:
            self.box = self.ipywidgets.VBox([self.ipywidgets.HBox(list(self.widgets[r])) for r in sorted(self.widgets)])
            self.last_text = 0.0  # show the new box at once


def bar(rank: int, done: int, total: int, width: int = 30) -> str:
    share = min(max(done / total, 0.0), 1.0) if total else 0.0
    filled = round(share * width)
    return f"rank {rank} |{'█' * filled}{'░' * (width - filled)}| {done}/{total}"
