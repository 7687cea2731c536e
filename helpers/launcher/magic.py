"""The %%torchrun cell magic: run a notebook cell as a worker script on N processes.

    %load_ext helpers
    %%torchrun -n 2
    import torch.distributed as dist
    dist.init_process_group("gloo")
    ...

The cell is written to runs/cells/<name>.py and launched with helpers.launch; the Run is stored in
the variable named by --out (default: last_run). Everything after `--` goes to the script's argv.
--timeout, --max-restarts, --fresh and --debug mean what launch()'s arguments of those names mean; without
--fresh, the platform's default applies (forked workers on Linux, fresh interpreters where forking is unsafe).
"""
from __future__ import annotations

import argparse
import shlex
from pathlib import Path

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


def register(ipython) -> None:
    from IPython.core.magic import register_cell_magic

    @register_cell_magic("torchrun")
    def torchrun(line: str, cell: str) -> None:
        run_cell(line, cell, ipython.user_ns)

    del torchrun
