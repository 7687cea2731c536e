"""Maintainers' tool: run a lesson top to bottom in a fresh kernel, store it in place, drop machine paths.

    python -m helpers.tools.notebook_tools notebooks/02_ddp.ipynb [more.ipynb ...]
    python -m helpers.tools.notebook_tools --no-store notebooks/02_ddp.ipynb    # run only (helpers.tools.sizing)

The one way the project executes a notebook: as JupyterLab's Run All does, cell by cell in one fresh kernel
started in the notebook's folder, going on past errors (cells tagged `raises-exception` are meant to raise).
It exits 1 when any other cell raised. Storing sets LESSONS_DATA=digits, so that the stored outputs match
what `pytest --nbval` computes. IPython prints the frame that raised with its absolute path; nbval never
compares tracebacks, so rewriting them to repository-relative paths changes no checked output.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

from helpers import REPO_ROOT
from helpers.tools import kernelspec

CELL_TIMEOUT = 300  # seconds; the slowest lesson cell takes about a minute on 2 busy cores


def _client_class():
    import nbclient

    class Client(nbclient.NotebookClient):
        """nbclient's runner, with one workaround: now and then (lesson 11 run three at a time on 2 cores: 2 runs of 12
        in one trial, 1 of 30 in another; each time at its widget cell) the kernel finishes a cell and goes idle, but
        its execute_reply never reaches the runner, which then waits out the timeout (jupyter/nbclient#312, open). When
        the timeout comes after the kernel's idle status for that very cell, the cell did finish: its outputs are all
        in, so the run goes on, and says so on stderr. Any other timeout is a real one and fails as before.
        The reply normally follows the idle status within milliseconds, so once the cell's outputs are complete
        the runner waits REPLY_GRACE seconds for it, not the whole cell timeout (a lost reply used to cost 300 s).
        The "ok" put in place of a lost reply loses no error only because execute() runs with allow_errors=True and
        reads errors from the cell's outputs, which are complete by then; with allow_errors=False a failed cell
        whose reply was lost would not raise."""

        REPLY_GRACE = 20.0  # seconds after the cell's idle status

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.finished_cells: set[int] = set()

        def process_message(self, msg, cell, cell_index):
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                self.finished_cells.add(id(cell))
            return super().process_message(msg, cell, cell_index)

        async def _async_poll_for_reply(self, msg_id, cell, timeout, task_poll_output_msg, task_poll_kernel_alive):
            reply = asyncio.ensure_future(super()._async_poll_for_reply(
                msg_id, cell, timeout, task_poll_output_msg, task_poll_kernel_alive))
            try:
                await asyncio.wait({reply, task_poll_output_msg}, return_when=asyncio.FIRST_COMPLETED)
                if not reply.done() and task_poll_output_msg.done() and not task_poll_output_msg.cancelled() \
                        and task_poll_output_msg.exception() is None and id(cell) in self.finished_cells:
                    await asyncio.wait({reply}, timeout=self.REPLY_GRACE)
                    if not reply.done():
                        reply.cancel()
                        task_poll_kernel_alive.cancel()
                        print(f"notebook_tools: the kernel went idle after the cell but its reply did not come within "
                              f"{self.REPLY_GRACE:g} s (jupyter/nbclient#312); its outputs are complete, going on",
                              file=sys.stderr)
                        return {"content": {"status": "ok", "execution_count": cell.get("execution_count")},
                                "parent_header": {"msg_id": msg_id}}
                return await reply
            except asyncio.CancelledError:  # nbclient cancels the poll when the kernel died
                reply.cancel()
                raise

        async def _async_handle_timeout(self, timeout, cell=None):
            if cell is not None and id(cell) in self.finished_cells:
                print(f"notebook_tools: the kernel went idle after the cell but its reply never came within "
                      f"{timeout} s (jupyter/nbclient#312); its outputs are complete, going on", file=sys.stderr)
                return {"content": {"status": "ok", "execution_count": cell.get("execution_count")}}
            return await super()._async_handle_timeout(timeout, cell)

    return Client


def execute(notebook: Path, store: bool = True) -> list[str]:
    """Run the notebook; store it in place if `store`. Returns the names of unexpected errors, by cell."""
    import nbformat

    if store:
        os.environ["LESSONS_DATA"] = "digits"  # the kernel inherits this process's environment
    cells = nbformat.read(notebook, as_version=4)
    _client_class()(cells, timeout=CELL_TIMEOUT, kernel_name="python3", allow_errors=True, record_timing=False,
                    resources={"metadata": {"path": str(notebook.parent)}}).execute()
    for cell in cells.cells:  # no timestamps of the maintainer's run in the lesson (or in a learner's hand-out)
        cell.metadata.pop("execution", None)
    errors = [f"cell {i}: {output.get('ename')}" for i, cell in enumerate(cells.cells) if cell.cell_type == "code"
              for output in cell.get("outputs", []) if output.get("output_type") == "error"
              and "raises-exception" not in cell.metadata.get("tags", [])]
    if store:
        nbformat.write(cells, notebook)
        strip_traceback_paths(notebook)
        kernelspec.fix(notebook)  # JupyterLab's own name for the kernel: opening the lesson leaves it unmodified
    return errors


def strip_traceback_paths(notebook: Path) -> int:
    """Rewrite absolute paths under the repository in stored tracebacks; return how many lines changed."""
    data = json.loads(notebook.read_text())
    prefix, changed = f"{REPO_ROOT}{os.sep}", 0
    for cell in data["cells"]:
        for output in cell.get("outputs", []):
            lines = output.get("traceback", [])
            for i, line in enumerate(lines):
                if prefix in line:
                    lines[i], changed = line.replace(prefix, ""), changed + 1
    notebook.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--no-store", action="store_true", help="run only; leave the file as it is")
    args = parser.parse_args()
    failed = False
    for notebook in args.notebooks:
        errors = execute(notebook.resolve(), store=not args.no_store)
        print(f"{notebook}: executed{'' if args.no_store else ' and stored'}"
              f"{'; errors in ' + ', '.join(errors) if errors else ''}", flush=True)
        failed = failed or bool(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
