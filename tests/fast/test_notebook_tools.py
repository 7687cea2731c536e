"""The maintainers' notebook runner's one workaround (helpers.tools.notebook_tools): a timeout after the kernel
went idle for that very cell is a lost execute_reply (jupyter/nbclient#312) and the run goes on; any other timeout
still fails."""
from __future__ import annotations

import asyncio

import nbformat
import pytest
from nbclient.exceptions import CellExecutionComplete, CellTimeoutError

from helpers.tools.notebook_tools import _client_class


def _client_and_cell():
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1 + 1")])
    return _client_class()(notebook, timeout=1, record_timing=False), notebook.cells[0]


def _status(state: str) -> dict:
    return {"msg_type": "status", "content": {"execution_state": state}, "header": {"msg_type": "status"},
            "parent_header": {}, "metadata": {}}


def test_a_timeout_after_the_cells_idle_status_goes_on(capsys):
    client, cell = _client_and_cell()
    client.process_message(_status("busy"), cell, 0)
    with pytest.raises(CellExecutionComplete):  # nbclient ends the cell's output loop by raising CellExecutionComplete
        client.process_message(_status("idle"), cell, 0)
    reply = asyncio.run(client._async_handle_timeout(1, cell))
    assert reply["content"]["status"] == "ok"
    assert "nbclient#312" in capsys.readouterr().err  # and it says so


def test_a_timeout_while_the_cell_still_runs_fails():
    client, cell = _client_and_cell()
    client.process_message(_status("busy"), cell, 0)  # busy, never idle: the cell was really still running
    with pytest.raises(CellTimeoutError):
        asyncio.run(client._async_handle_timeout(1, cell))


def test_another_cells_idle_status_does_not_count():
    client, cell = _client_and_cell()
    other = nbformat.v4.new_code_cell("2 + 2")
    with pytest.raises(CellExecutionComplete):
        client.process_message(_status("idle"), other, 1)
    with pytest.raises(CellTimeoutError):
        asyncio.run(client._async_handle_timeout(1, cell))
