"""The notebook's magics: %%torchrun runs a cell as a worker script on N processes; %ranks / %%ranks keep a group of
live ranks that run cells (helpers/launcher/live.py).

    %load_ext helpers
    %%torchrun -n 2
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ...

The cell is written to runs/cells/<name>.py and launched with helpers.launch; the Run is stored in
the variable named by --out (default: last_run). Everything after `--` goes to the script's argv.
--timeout, --max-restarts, --fresh and --debug mean what launch()'s arguments of those names mean; without
--fresh, the platform's default applies (forked workers on Linux, fresh interpreters where forking is unsafe).

    %ranks start -n 2 [--fresh] [--debug]     start live ranks (stopping any running)
    %%ranks [RANKS] [--timeout S]             run the cell on RANKS (1, 0,2, 0-3; default all); the value of its last
                                              expression comes back as a list indexed by rank
    %ranks get EXPR                           EXPR on every rank, as a list indexed by rank
    %ranks status | stop | restart [-n N]
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from helpers.launcher import live
from helpers.launcher.api import launch


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="%%torchrun", add_help=False, exit_on_error=False)
    parser.add_argument("-n", "--nproc", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--fresh", action="store_true", default=None)  # None: launch()'s platform default
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--name", default="cell")
    parser.add_argument("--out", default="last_run")
    return parser


def parse_line(line: str) -> tuple[argparse.Namespace, list[str]]:
    words = shlex.split(line)
    script_args = words[words.index("--") + 1:] if "--" in words else []
    words = words[:words.index("--")] if "--" in words else words
    try:
        options, unknown = _parser().parse_known_args(words)
    except argparse.ArgumentError as error:
        raise ValueError(f"%%torchrun: {error}") from None
    if unknown:
        raise ValueError(f"%%torchrun: unknown option(s) {' '.join(unknown)}; usage: %%torchrun -n 2 "
                         f"[--timeout S] [--max-restarts K] [--fresh] [--debug] [--name NAME] [--out VAR] [-- args]")
    return options, script_args


def run_cell(line: str, cell: str, namespace: dict) -> None:
    __tracebackhide__ = True
    options, script_args = parse_line(line)
    path = Path("runs") / "cells" / f"{options.name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(cell)
    namespace[options.out] = launch(path, nproc=options.nproc, args=script_args, timeout=options.timeout,
                                    max_restarts=options.max_restarts, fresh=options.fresh,
                                    debug=options.debug)


RANKS_USAGE = ("usage: %ranks start [-n N] [--fresh] [--debug] | status | stop | restart [-n N] | get EXPR;  "
               "%%ranks [RANKS] [--timeout S]")


def _start_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, add_help=False, exit_on_error=False)
    parser.add_argument("-n", "--nproc", type=int, default=None)
    parser.add_argument("--fresh", action="store_true", default=None)
    parser.add_argument("--debug", action="store_true", default=None)
    return parser


def _parse(parser: argparse.ArgumentParser, words: list[str]) -> argparse.Namespace:
    try:
        options, unknown = parser.parse_known_args(words)
    except argparse.ArgumentError as error:
        raise ValueError(f"{parser.prog}: {error}; {RANKS_USAGE}") from None
    if unknown:
        raise ValueError(f"{parser.prog}: unknown option(s) {' '.join(unknown)}; {RANKS_USAGE}")
    return options


def ranks_line(line: str, number: int | None = None):
    """%ranks COMMAND ...: start, status, stop, restart, get."""
    __tracebackhide__ = True
    command, _, rest = line.strip().partition(" ")
    if command == "get":
        return live.current().get(rest, number=number)
    words = shlex.split(rest)
    if command in ("start", "restart"):
        options = vars(_parse(_start_parser(f"%ranks {command}"), words))
        if command == "restart":
            live.restart(**options)
        else:
            live.start(**{key: value for key, value in options.items() if value is not None})
        return None
    if words or command not in ("status", "stop"):
        raise ValueError(f"%ranks: unknown command {line.strip()!r}; {RANKS_USAGE}")
    if command == "status":
        session = live.LiveRanks.session
        print(session.status() if session else "No live ranks: start them with %ranks start -n 2.")
    else:
        running = live.LiveRanks.session is not None and not live.LiveRanks.session.gone
        live.stop()
        print("The live ranks are stopped." if running else "No live ranks were running.")
    return None


def ranks_cell(line: str, cell: str, number: int | None = None):
    """%%ranks [RANKS] [--timeout S]: run the cell on the live ranks."""
    __tracebackhide__ = True
    parser = argparse.ArgumentParser(prog="%%ranks", add_help=False, exit_on_error=False)
    parser.add_argument("--timeout", type=float, default=None)
    try:
        options, ranks = parser.parse_known_args(shlex.split(line))
    except argparse.ArgumentError as error:
        raise ValueError(f"%%ranks: {error}; {RANKS_USAGE}") from None
    if any(word.startswith("-") for word in ranks):
        raise ValueError(f"%%ranks: unknown option(s) {' '.join(w for w in ranks if w.startswith('-'))}; "
                         f"{RANKS_USAGE}")
    # a blank first line stands for the %%ranks line, so that line numbers are the cell's as the notebook shows it
    return live.current().run("\n" + cell, " ".join(ranks), number=number, timeout=options.timeout)


def _cell_number(ipython) -> int | None:
    """The running cell's n in In[n], as the notebook shows it; None outside a cell run (then the session counts)."""
    result = getattr(getattr(ipython, "displayhook", None), "exec_result", None)
    return getattr(result, "execution_count", None)


def register(ipython) -> None:
    from IPython.core.magic import register_cell_magic, register_line_cell_magic

    @register_cell_magic("torchrun")
    def torchrun(line: str, cell: str) -> None:
        run_cell(line, cell, ipython.user_ns)

    @register_line_cell_magic("ranks")
    def ranks(line: str, cell: str | None = None):
        if cell is None:
            return ranks_line(line, _cell_number(ipython))
        return ranks_cell(line, cell, _cell_number(ipython))

    del torchrun, ranks
