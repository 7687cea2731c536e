"""The maintainers' notebook runner's one workaround (helpers.tools.notebook_tools): a timeout after the kernel
went idle for that very cell is a lost execute_reply (jupyter/nbclient#312) and the run goes on; any other timeout
still fails. These call the overridden coroutines directly; that nbclient itself still calls them (so the workaround is
in effect) is pinned in tests/fast/test_private_apis.py."""
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


class _SilentShell:
    """A shell channel on which the execute_reply never comes (what nbclient#312 looks like to the runner)."""

    async def get_msg(self, timeout=None):
        await asyncio.sleep(timeout)
        from queue import Empty
        raise Empty


class _Kernel:
    shell_channel = _SilentShell()

    async def is_alive(self):  # what nbclient asks when the reply times out
        return True


class _LateShell:
    """A shell channel whose execute_reply comes 0.1 s after the cell's idle status, with the kernel's own status."""

    async def get_msg(self, timeout=None):
        await asyncio.sleep(0.1)
        return {"parent_header": {"msg_id": "m3"}, "content": {"status": "error", "execution_count": 7},
                "header": {"date": None}}


class _LateKernel(_Kernel):
    shell_channel = _LateShell()


async def _poll_with_outputs_done(client, cell, timeout: float) -> tuple[dict, float]:
    import time

    client.kc = _Kernel()
    client.REPLY_GRACE = 0.2

    async def outputs():  # the cell's output loop, ended by its idle status
        with pytest.raises(CellExecutionComplete):
            client.process_message(_status("idle"), cell, 0)

    alive = asyncio.ensure_future(asyncio.sleep(3600))
    started = time.monotonic()
    reply = await client._async_poll_for_reply("m1", cell, timeout, asyncio.ensure_future(outputs()), alive)
    return reply, time.monotonic() - started


def test_a_lost_reply_costs_the_grace_period_not_the_cell_timeout(capsys):
    # Catches a runner that waits out the whole cell timeout (300 s in use; 30 s here) for a reply that never comes.
    client, cell = _client_and_cell()
    reply, waited = asyncio.run(_poll_with_outputs_done(client, cell, timeout=30))
    assert reply["content"]["status"] == "ok" and reply["parent_header"]["msg_id"] == "m1"
    assert waited < 5
    assert "within 0.2 s" in capsys.readouterr().err


def test_a_cell_still_running_is_not_cut_short_by_the_grace_period():
    # Catches a grace period that starts before the cell's idle status: with outputs still coming, the runner
    # must wait for the reply (here: until the cell timeout, 1 s, which fails as a real timeout).
    client, cell = _client_and_cell()
    client.kc = _Kernel()
    client.REPLY_GRACE = 0.01

    async def run():
        alive = asyncio.ensure_future(asyncio.sleep(3600))
        outputs = asyncio.ensure_future(asyncio.sleep(3600))  # the cell's output loop: still going
        return await client._async_poll_for_reply("m2", cell, 1, outputs, alive)

    with pytest.raises(CellTimeoutError):
        asyncio.run(run())


def test_a_reply_within_the_grace_period_is_the_one_returned():
    # Catches a runner that answers "ok" as soon as the outputs are complete without waiting for the reply: the
    # kernel's own reply (here an error status) must win when it comes within the grace period.
    client, cell = _client_and_cell()

    async def run():
        client.kc = _LateKernel()
        client.REPLY_GRACE = 5

        async def outputs():
            with pytest.raises(CellExecutionComplete):
                client.process_message(_status("idle"), cell, 0)

        alive = asyncio.ensure_future(asyncio.sleep(3600))
        return await client._async_poll_for_reply("m3", cell, 30, asyncio.ensure_future(outputs()), alive)

    reply = asyncio.run(run())
    assert reply["content"] == {"status": "error", "execution_count": 7}
