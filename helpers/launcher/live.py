"""Live ranks: workers that stay up between notebook cells, each with its own variables (the %ranks magic).

    %ranks start -n 2          a launch whose worker script is a cell loop (helpers/launcher/live_rank.py)
    %%ranks [RANKS]            the cell runs on those ranks (all by default); output labelled by rank, live
    %ranks get x               [x on rank 0, x on rank 1]
    %ranks status | stop | restart

A session is an ordinary launch (api.Job: the launch server, torch's elastic agent, the run folder, the console).
Its workers connect back to this kernel on a loopback socket (helpers/kit/live_wire.py): the kernel sends each cell
to the ranks that run it and waits for every one of them to answer, showing their output meanwhile. What can go wrong,
and what the learner is told:
- a cell raises on some ranks: CellFailed names each rank and its cell line; every rank keeps its variables;
- ■ Stop (KeyboardInterrupt) or --timeout: every rank running the cell dumps its stack and gets SIGINT; the error says
  where each one was. A rank waiting inside a collective cannot be interrupted (gloo and nccl wait in C++), so the
  process group is then broken, and the error says that %ranks restart brings it back;
- a rank dies: the launch ends as any launch does (torch's agent stops the others) and the diagnosis names the rank,
  its exit code, its traceback and its cell line (api.wait's WorkerFailed);
- the kernel dies: the launch server kills every agent's process group (server.py), as for any launch.
"""
from __future__ import annotations

import ast
import linecache
import os
import secrets
import select
import signal
import socket
import time
from pathlib import Path
from typing import Any, ClassVar

from helpers.kit import live_wire
from helpers.launcher import diagnosis
from helpers.launcher.api import _LIBRARY_DIRS, Job, WorkerFailed, fresh_or_default, wait
from helpers.launcher.live_text import (
    RESTART,
    CellFailed,
    CellInterrupted,
    CellTimeout,
    RanksUnavailable,
    broken_message,
    death_message,
    failure_message,
    parse_ranks,
    per_rank,
    unpack,
)
from helpers.launcher.run_folder import STACK_SIGNAL, short_path
from helpers.launcher.spec import build_spec, new_run_dir

CELL_LOOP = Path(__file__).with_name("live_rank.py")
READY_TIMEOUT = 180.0  # seconds for every rank to join: a first start imports torch in the launch server (tens of s)
HOLD = 0.5  # seconds a cell's output is held back, so that a quick cell prints rank by rank, not interleaved
STOP_GRACE = 1.0  # seconds an interrupted rank has to answer before it counts as stuck
DUMP_WAIT = 0.3  # seconds to wait for a rank's stack dump before interrupting it anyway
INTERRUPT_EVERY = 0.15  # seconds between SIGINTs to a rank that has not answered (see LiveRanks._where)
LEAVE_GRACE = 10.0  # seconds for torch's agent to notice that a rank died and stop the others
NOTE_AFTER = 1.0  # seconds after a rank failed, while others still run the cell, before saying where they are


# ---------------------------------------------------------------------------- the session

class LiveRanks:
    """One group of live ranks: a launch whose workers run the cells this kernel sends them."""

    session: ClassVar[LiveRanks | None] = None  # this kernel's ranks (%ranks works on this one)

    def __init__(self, nproc: int = 2, fresh: bool | None = None, debug: bool = False,
                 ready_timeout: float = READY_TIMEOUT) -> None:
        if not isinstance(nproc, int) or isinstance(nproc, bool) or nproc < 1:
            raise ValueError(f"nproc must be a whole number >= 1, got {nproc!r}")
        self.options = {"nproc": nproc, "fresh": fresh, "debug": debug}
        self.nproc, self.cells, self.gone = nproc, 0, None
        self.conns: dict[int, socket.socket] = {}
        self.readers: dict[int, live_wire.Reader] = {}
        self.pids: dict[int, int] = {}
        self.busy: dict[int, int] = {}  # rank -> the cell it has not answered yet
        self.answers: dict[int, tuple[dict, bytes]] = {}
        self.stuck_where: dict[int, str] = {}
        self.marks: dict[int, int] = {}  # rank -> how many of its lines came before the running cell
        self.backend = self.device = None
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(nproc)
        token = secrets.token_hex(16)
        run_dir = new_run_dir(CELL_LOOP, None)
        spec = build_spec(CELL_LOOP, nproc, (), 0, {}, run_dir, fresh_or_default(fresh), debug=debug)
        spec["env"][live_wire.ADDRESS] = f"127.0.0.1:{self.listener.getsockname()[1]}"
        spec["env"][live_wire.TOKEN] = token
        print(f"Starting {nproc} live rank{'s' if nproc > 1 else ''} (torch's elastic agent, as for a launch)...",
              flush=True)
        self.job = Job(spec, echo=True)
        try:
            self._join(token, ready_timeout)
        except KeyboardInterrupt:
            self._shut()
            raise CellInterrupted("Interrupted while the ranks started: every rank was stopped.", {}, set()) from None
        except BaseException:
            self._shut()
            raise
        finally:
            self.listener.close()
        who = f"Ranks 0-{nproc - 1}" if nproc > 1 else "Rank 0"
        device = "cuda:<local rank>" if self.device.startswith("cuda") else self.device
        print(f"{who} joined the process group (backend {self.backend}, device {device}). %%ranks runs a cell on "
              "them.", flush=True)

    # -- starting
    def _join(self, token: str, timeout: float) -> None:
        """Accept each rank's connection, check its token, and wait until every rank has joined the process group."""
        strangers: dict[socket.socket, live_wire.Reader] = {}
        try:
            self._accept(token, timeout, strangers)
        finally:
            for conn in strangers:
                conn.close()

    def _accept(self, token: str, timeout: float, strangers: dict[socket.socket, live_wire.Reader]) -> None:
        ready: set[int] = set()
        deadline = time.monotonic() + timeout
        while len(ready) < self.nproc:
            readable = select.select([self.listener, *strangers, *self.conns.values()], [], [], 0.1)[0]
            if self.listener in readable:
                conn, _ = self.listener.accept()
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                strangers[conn] = live_wire.Reader()
            for rank, conn in list(self.conns.items()):
                if conn in readable:
                    self._take(rank, self._receive(rank), ready)
            for conn in [c for c in readable if c in strangers]:
                data = conn.recv(65536)
                try:
                    messages = strangers[conn].feed(data) if data else []
                except ValueError:  # not our framing
                    messages, data = [], b""
                if data and not messages:
                    continue  # its hello is not complete yet
                if not messages or messages[0][0].get("hello") != token:  # closed, or not one of our ranks
                    strangers.pop(conn).close()
                    continue
                hello = messages[0][0]
                rank = int(hello["rank"])
                self.conns[rank], self.readers[rank], self.pids[rank] = conn, strangers.pop(conn), int(hello["pid"])
                self._take(rank, messages[1:], ready)
            self._show()
            if self.job.agent.poll() is not None:
                self._died()
            if time.monotonic() > deadline:
                raise RanksUnavailable(f"the ranks did not all join within {timeout:g} s (ranks ready: "
                                       f"{sorted(ready) or 'none'}); logs: {short_path(self.job.run_dir)}/")

    def _take(self, rank: int, messages: list, ready: set[int]) -> None:
        for header, _ in messages:
            if "ready" in header:
                ready.add(rank)
                self.backend, self.device = header["backend"], header["device"]

    # -- the connection
    def _receive(self, rank: int) -> list[tuple[dict, bytes]]:
        """What rank's socket has delivered (call when select says it is readable); a closed socket: the rank died."""
        try:
            data = self.conns[rank].recv(1 << 20)
        except OSError:
            data = b""
        if not data:
            self._died(rank)
        return self.readers[rank].feed(data)

    def _poll(self, seconds: float) -> None:
        """Wait up to `seconds` for the ranks; file each reply to the cell its rank is busy with (older replies, to
        a cell the kernel stopped waiting for, are dropped)."""
        readable = select.select(list(self.conns.values()), [], [], seconds)[0]
        for rank, conn in list(self.conns.items()):
            if conn not in readable:
                continue
            for header, blob in self._receive(rank):
                if "cell" in header and self.busy.get(rank) == header["cell"]:
                    del self.busy[rank]
                    self.stuck_where.pop(rank, None)
                    self.answers[rank] = (header, blob)

    def _show(self) -> bool:
        """Print the ranks' new lines, labelled; True when there were any."""
        lines = self.job.folder.collect()
        self.job.echo.show(lines)
        return bool(lines)

    # -- running cells
    def run(self, source: str, ranks: str | list[int] | None = None, number: int | None = None,
            timeout: float | None = None, keep_none: bool = False) -> Any:
        """Run `source` on `ranks` (default all); the value of its last expression on each rank (per_rank)."""
        __tracebackhide__ = True
        self._check_usable()
        chosen = ranks if isinstance(ranks, list) else parse_ranks(ranks, self.nproc)
        self.cells += 1
        cell = self.cells
        filename = f"In[{number if number is not None else cell}]"
        self._show()  # what the ranks printed between cells, before this cell's lines
        self.marks = {rank: len(lines) for rank, lines in self.job.folder.lines.items()}
        linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)
        message = live_wire.frame({"op": "run", "cell": cell, "source": source, "filename": filename})
        for rank in chosen:
            self.busy[rank] = cell
            try:
                self.conns[rank].sendall(message)
            except OSError:
                self._died()
        replies = self._follow(cell, chosen, timeout)
        failed = {rank: header for rank, (header, _) in replies.items() if header["status"] != "ok"}
        if failed:
            others = {rank: "finished the cell." for rank in replies if rank not in failed}
            raise CellFailed(failure_message(failed, others), failed)
        return per_rank({rank: unpack(*replies[rank]) for rank in chosen}, self.nproc, keep_none)

    def get(self, expression: str, number: int | None = None) -> list[Any]:
        """The value of `expression` on every rank, as a list indexed by rank."""
        __tracebackhide__ = True
        try:
            ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise ValueError(f"%ranks get: {expression!r} is not an expression (usage: %ranks get x)") from None
        return self.run(expression.strip(), number=number, keep_none=True)

    def _follow(self, cell: int, chosen: list[int], timeout: float | None) -> dict[int, tuple[dict, bytes]]:
        """Wait for every chosen rank's answer, showing output; stop the cell on ■ Stop or past `timeout`."""
        started = time.monotonic()
        pause, noted, failed_at = 0.02, False, None
        try:
            while any(rank not in self.answers for rank in chosen):
                self._poll(pause)
                if self.job.agent.poll() is not None:
                    self._died()
                now = time.monotonic()
                if now - started >= HOLD:
                    pause = 0.02 if self._show() else min(0.2, pause * 1.5)
                if failed_at is None and any(self.answers[r][0]["status"] != "ok" for r in chosen if r in self.answers):
                    failed_at = now
                if failed_at is not None and not noted and now - failed_at > NOTE_AFTER:
                    noted = True
                    self._note_waiting(chosen)
                if timeout is not None and now - started > timeout:
                    raise self._stop_cell(chosen, f"Timed out after {timeout:g} s", CellTimeout)
        except KeyboardInterrupt:
            raise self._stop_cell(chosen, "Interrupted (KeyboardInterrupt)", CellInterrupted) from None
        self._show()
        return {rank: self.answers.pop(rank) for rank in chosen}

    def _note_waiting(self, chosen: list[int]) -> None:
        running = [rank for rank in chosen if rank not in self.answers]
        where = self._where(running, interrupt=False)
        failed = sorted(r for r in chosen if r in self.answers and self.answers[r][0]["status"] != "ok")
        self._show()
        print(f"(rank {', '.join(map(str, failed))} failed; still running: "
              + "; ".join(f"rank {rank} {where.get(rank, '?')}" for rank in running)
              + ". A rank waiting for a failed rank in a collective waits until the process group's timeout: "
                "press ■ Stop to interrupt the cell.)", flush=True)

    def _where(self, ranks: list[int], interrupt: bool) -> dict[int, str]:
        """Where each of `ranks` is (one line each, diagnosis.where), from the stacks each dumps on STACK_SIGNAL. With
        `interrupt`, SIGINT each rank once its stack is in, and wait until each has answered or is known to wait inside
        a collective.

        SIGINT goes after the dump, and again every INTERRUPT_EVERY seconds to a rank that has not answered: Linux hands
        a signal sent to a process to its main thread only if that thread has no other signal pending, else to any
        thread (kernel/signal.c, complete_signal), and a rank's main thread asleep in a system call (time.sleep) wakes
        only for a signal of its own. Python runs the handler in the main thread at the next chance; it raises once."""
        folder = self.job.folder
        sizes = {rank: size for rank, size in folder.stack_sizes().items() if rank in ranks}
        self._signal(ranks, STACK_SIGNAL)
        where: dict[int, str] = {}
        previous: dict[int, str] = {}
        started = time.monotonic()
        interrupted = None
        while time.monotonic() - started < STOP_GRACE:
            self._poll(0.02)
            stacks = folder.stacks_since(sizes)
            for rank in {rank for rank, text in stacks.items() if text and text == previous.get(rank)} - set(where):
                where[rank] = diagnosis.where(stacks[rank], self.job.spec["script"], _LIBRARY_DIRS,
                                              read_line=linecache.getline)
            previous = stacks
            undecided = [rank for rank in ranks if rank not in where or (
                interrupt and rank not in self.answers and not where[rank].startswith("waiting in dist."))]
            if not undecided:
                break
            now = time.monotonic()
            if interrupt and (len(where) == len(ranks) or now - started > DUMP_WAIT) and (
                    interrupted is None or now - interrupted > INTERRUPT_EVERY):
                self._signal([rank for rank in ranks if rank not in self.answers], signal.SIGINT)
                interrupted = now
        return where

    def _signal(self, ranks: list[int], signal_number: int) -> None:
        for rank in ranks:
            try:
                os.kill(self.pids[rank], signal_number)
            except ProcessLookupError:
                pass

    def _stop_cell(self, chosen: list[int], headline: str, kind: type) -> BaseException:
        """Interrupt the ranks still running the cell; the error says where each was, and whether the group is
        still usable."""
        running = [rank for rank in chosen if rank not in self.answers]
        where = self._where(running, interrupt=True)
        self._show()
        said: dict[int, str] = {}
        for rank in range(self.nproc):
            reply = self.answers.get(rank, ({}, b""))[0]
            if rank not in chosen:
                said[rank] = "not running this cell"
            elif rank not in running:
                said[rank] = (f"had failed at {reply.get('where')}: {reply.get('error')}" if reply.get("status") ==
                              "error" else "had finished the cell")
            elif rank in self.answers:
                outcome = {"interrupted": "interrupted", "ok": "it finished the cell"}.get(
                    reply.get("status"), f"it failed: {reply.get('error')}")
                said[rank] = f"{where.get(rank, 'no stack')}; {outcome}"
            else:
                said[rank] = f"{where.get(rank, 'no stack')}; still there"
        stuck = {rank for rank in running if rank not in self.answers}
        for rank in chosen:
            self.answers.pop(rank, None)
        self.stuck_where = {rank: where.get(rank, "no stack") for rank in stuck}
        logs = {rank: "\n".join(self.job.folder.lines.get(rank, [])[self.marks.get(rank, 0):]) for rank in chosen}
        message = diagnosis.hang_message(headline, said, logs, str(short_path(self.job.run_dir)))
        if stuck:
            message += "\n" + broken_message(self.stuck_where)
        else:
            message += "\nEvery rank stopped the cell and keeps its variables; the ranks are ready for the next cell."
        return kind(message, {rank: where.get(rank, "no stack") for rank in running}, stuck)

    # -- the session's state
    def _check_usable(self) -> None:
        __tracebackhide__ = True
        if self.gone:
            raise RanksUnavailable(self.gone)
        if self.job.agent.poll() is not None:
            self._died()
        self._poll(0)
        if self.busy:
            raise RanksUnavailable(broken_message({rank: self.stuck_where.get(rank, "still running an earlier cell")
                                                   for rank in self.busy}))
        self.answers.clear()

    def _died(self, left: int | None = None) -> None:
        """A rank's connection closed (rank `left`'s, if known) or the agent exited: follow the launch to its end
        (api.wait), which raises the diagnosis (the rank that failed first, its exit code, traceback and line)."""
        __tracebackhide__ = True
        self.gone = f"The ranks are gone (a rank died). {RESTART}"
        self._close_sockets()  # ranks waiting for a cell see the connection close and leave too
        deadline = time.monotonic() + LEAVE_GRACE
        while self.job.agent.poll() is None and time.monotonic() < deadline:
            self._show()
            time.sleep(0.05)
        if self.job.agent.poll() is None:  # the agent still waits for ranks busy in a cell
            self._shut()
        else:
            try:
                wait([self.job], timeout=30)
            except WorkerFailed as failure:
                raise WorkerFailed(death_message(failure), rank=failure.rank, exitcode=failure.exitcode,
                                   run=failure.run, where=failure.where, error=failure.error,
                                   meaning=failure.meaning) from None
        who = "A rank" if left is None else f"Rank {left}"
        self.gone = (f"{who} left without an error (exit code 0: sys.exit() or exit() in a cell ends a rank, as it "
                     f"ends a script), and the other ranks were stopped. {RESTART}")
        raise RanksUnavailable(self.gone)

    def status(self) -> str:
        """One paragraph: how many ranks, their backend and device, how many cells ran, the logs; or what is wrong."""
        try:
            if self.gone:
                return self.gone
            if self.job.agent.poll() is not None:
                self._died()
            self._poll(0)
        except (WorkerFailed, RanksUnavailable) as failure:  # the ranks died since the last cell: say how
            return str(failure)
        head = (f"{self.nproc} live rank{'s' if self.nproc > 1 else ''} (backend {self.backend}, device {self.device}),"
                f" {self.cells} cell{'s' if self.cells != 1 else ''} run; logs: {short_path(self.job.run_dir)}/")
        if self.busy:
            return head + "\n" + broken_message({rank: self.stuck_where.get(rank, "still running an earlier cell")
                                                 for rank in self.busy})
        return head

    def stop(self) -> None:
        """Ask every rank to leave; whatever has not left after a few seconds is stopped as a launch is."""
        for conn in self.conns.values():
            try:
                conn.sendall(live_wire.frame({"op": "exit"}))
            except OSError:
                pass
        deadline = time.monotonic() + (3.0 if not self.busy else 0.0)
        while self.job.agent.poll() is None and time.monotonic() < deadline:
            self._show()
            time.sleep(0.05)
        self._shut()
        self.gone = self.gone or f"The ranks were stopped. {RESTART}"

    def _shut(self) -> None:
        self.job.stop()
        self.job.echo.show(self.job.folder.collect(final=True))
        self._close_sockets()

    def _close_sockets(self) -> None:
        for conn in self.conns.values():
            conn.close()
        self.conns.clear()


# ---------------------------------------------------------------------------- what the magic calls

def start(nproc: int = 2, fresh: bool | None = None, debug: bool = False) -> LiveRanks:
    """Start this kernel's live ranks (stopping the ones running, if any)."""
    if LiveRanks.session is not None and not LiveRanks.session.gone:
        print("Stopping the live ranks already running first (their variables are lost).", flush=True)
        LiveRanks.session.stop()
    LiveRanks.session = None
    LiveRanks.session = LiveRanks(nproc, fresh, debug)
    return LiveRanks.session


def restart(**changes: Any) -> LiveRanks:
    """Stop this kernel's ranks and start the same number again (or what `changes` says)."""
    previous = current()
    return start(**{**previous.options, **{key: value for key, value in changes.items() if value is not None}})


def current() -> LiveRanks:
    __tracebackhide__ = True
    if LiveRanks.session is None:
        raise RanksUnavailable("no live ranks in this kernel: start them with %ranks start -n 2")
    return LiveRanks.session


def stop() -> None:
    if LiveRanks.session is not None:
        LiveRanks.session.stop()
