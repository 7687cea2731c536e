"""What each live rank runs (``%ranks start``): connect to the notebook kernel, join the process group, then run the
cells the kernel sends, each rank in a namespace of its own that lasts from cell to cell.

The launcher starts this file as the worker script of an ordinary launch (helpers/launcher/live.py), through torch's
elastic agent, so the bootstrap has already tied the process to its agent, registered it in the run folder and set up
its stack dumps. Worker side: the standard library, torch and helpers.kit only.

A cell runs as IPython runs one: its statements, then its last expression, whose value goes back to the kernel
(pickled, tensors moved to the CPU). Its code is compiled under the name the kernel gives it ("In[7]") and its source
goes into linecache, so a traceback shows the cell's own lines and line numbers. SIGINT (the kernel's ■ Stop) raises
KeyboardInterrupt in a running cell and is ignored between cells. A collective waiting inside C++ (gloo, nccl) does not
return to Python until it completes, so SIGINT cannot interrupt it: the kernel says so.
"""
from __future__ import annotations

import ast
import builtins
import io
import linecache
import os
import pickle
import signal
import socket
import sys
import traceback
from typing import Any

import torch
import torch.distributed as dist

from helpers.kit import live_wire
from helpers.kit.distributed import init_distributed

REPR_LIMIT = 4000  # characters of a value's repr sent along (shown when the value cannot travel)
_interruptible = False  # True only while a cell's own code runs


def _interrupt(signum, frame) -> None:
    """SIGINT: KeyboardInterrupt inside a running cell, once; nothing between cells."""
    global _interruptible
    if _interruptible:
        _interruptible = False
        raise KeyboardInterrupt


def compile_cell(source: str, filename: str) -> tuple[Any, Any]:
    """(the cell's statements, its last expression or None), compiled under `filename` with the cell's line numbers.
    A trailing semicolon hides the last expression's value, as in IPython."""
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)


def remember_source(source: str, filename: str) -> None:
    """Put the cell's source where tracebacks look for it (mtime None: linecache.checkcache keeps it)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(keepends=True), filename)


class _CpuPickler(pickle.Pickler):
    """Pickles tensors that live on an accelerator as CPU copies: the kernel must not touch the GPU."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) in (torch.Tensor, torch.nn.Parameter) and obj.device.type != "cpu":
            return obj.detach().cpu().__reduce_ex__(self.proto)
        return NotImplemented


def pack(value: Any) -> tuple[dict[str, Any], bytes]:
    """A value as (header fields, blob): pickled when it can be, and its repr in any case."""
    try:
        text = repr(value)
    except Exception as error:  # a repr that raises must not lose the cell's result
        text = f"<repr failed: {type(error).__name__}: {error}>"
    if len(text) > REPR_LIMIT:
        text = text[:REPR_LIMIT] + " ..."
    buffer = io.BytesIO()
    try:
        _CpuPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    except Exception as error:
        return {"value": "repr", "repr": text, "why": f"{type(error).__name__}: {error}"}, b""
    return {"value": "pickle", "repr": text}, buffer.getvalue()


def _learner_traceback(error: BaseException) -> tuple[str, str | None]:
    """(the traceback without this module's frames, the cell line it points at: "In[7]:3 (in f)")."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(error), error, tb))
    where = None
    for frame, line in traceback.walk_tb(tb):
        if frame.f_code.co_filename.startswith("In["):
            where = f"{frame.f_code.co_filename}:{line} (in {frame.f_code.co_name})"
    if where is None and isinstance(error, SyntaxError) and (error.filename or "").startswith("In["):
        where = f"{error.filename}:{error.lineno}"
    return text, where


def execute(source: str, filename: str, namespace: dict[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Run one cell in `namespace`: ({"status": "ok" | "error" | "interrupted", ...}, the value's blob).
    SystemExit is not caught: like a script's, it ends the rank."""
    global _interruptible
    remember_source(source, filename)
    try:
        try:
            body, last = compile_cell(source, filename)
            _interruptible = True
            exec(body, namespace)
            value = eval(last, namespace) if last is not None else None
        finally:
            _interruptible = False
    except KeyboardInterrupt as error:
        text, where = _learner_traceback(error)
        return {"status": "interrupted", "traceback": text, "where": where, "error": "KeyboardInterrupt"}, b""
    except SystemExit:
        raise
    except BaseException as error:
        text, where = _learner_traceback(error)
        last_line = traceback.format_exception_only(type(error), error)[-1].strip()
        return {"status": "error", "traceback": text, "where": where, "error": last_line}, b""
    if value is None:
        return {"status": "ok", "value": None}, b""
    header, blob = pack(value)
    return {"status": "ok", **header}, blob


def new_namespace(rank: int, world_size: int, device: torch.device) -> dict[str, Any]:
    """What every cell can use without importing it."""
    return {"__name__": "__main__", "__builtins__": builtins, "torch": torch, "dist": dist, "rank": rank,
            "world_size": world_size, "device": device}


def serve(sock: socket.socket, namespace: dict[str, Any]) -> None:
    """Run cells until the kernel says exit or goes away."""
    reader, pending = live_wire.Reader(), []
    while True:
        try:
            header, _ = live_wire.receive(sock, reader, pending)
        except live_wire.Closed:
            return
        except KeyboardInterrupt:  # a stray SIGINT that raced the end of a cell
            continue
        if header.get("op") == "exit":
            return
        reply, blob = execute(header["source"], header["filename"], namespace)
        sys.stdout.flush()
        sys.stderr.flush()
        live_wire.send(sock, {"cell": header["cell"], **reply}, blob)


def main() -> None:
    # The bootstrap put this file's folder first on sys.path, as it does for any script; a cell should import what
    # the notebook imports (the working directory first), not the launcher's modules.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = ["", *(entry for entry in sys.path if entry != here)]
    host, port = os.environ[live_wire.ADDRESS].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    live_wire.send(sock, {"hello": os.environ[live_wire.TOKEN], "rank": int(os.environ.get("RANK", 0)),
                          "pid": os.getpid()})
    rank, world_size, device = init_distributed()
    live_wire.send(sock, {"ready": rank, "backend": dist.get_backend(), "device": str(device)})
    signal.signal(signal.SIGINT, _interrupt)
    serve(sock, new_namespace(rank, world_size, device))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if dist.is_initialized():  # a cell may have destroyed it already
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
