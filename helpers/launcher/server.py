"""The launch server: a clean process that has imported torch once, and forks an agent per launch.

Why: starting a worker the usual way costs a fresh interpreter plus ``import torch`` (seconds);
forking from a process that already imported torch costs milliseconds. The server is never the
notebook kernel itself: the kernel may hold CUDA state, threads and sockets that must not be forked.
The server imports torch but never touches CUDA, so forked workers may still initialise it.

Protocol (JSON lines): the kernel writes ``{"spec": {...}}`` on stdin; the server answers
``{"started": pid}`` (the agent's pid, also its process-group id) and later ``{"exited": pid,
"code": n}``, or ``{"error": "why"}`` for a request it cannot start (a malformed line, a failed fork): that launch
fails, and the server and every other launch go on. When stdin closes (the kernel exited or died) every agent group
is killed.
"""
from __future__ import annotations

import gc
import json
import os
import select
import signal
import sys
import traceback

from helpers.launcher import run_folder
from helpers.launcher.run_folder import AGENT_DIED

agents: set[int] = set()
# What _start_agent reads from a spec before it can write anything to the run folder (spec.build_spec writes them all).
_NEEDED = ("run_dir", "node_rank", "cwd", "env")


def _send(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _start_agent(spec: dict) -> int:
    pid = os.fork()
    if pid:
        return pid
    code = AGENT_DIED
    try:
        os.setpgid(0, 0)
        from helpers.launcher.agent import run_agent
        from helpers.launcher.bootstrap import die_with_parent

        die_with_parent()
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        log = os.open(run_folder.node_file(spec["run_dir"], "agent_log", spec["node_rank"]),
                      os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(spec["cwd"])
        os.environ.clear()
        os.environ.update(spec["env"])
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        code = run_agent(spec)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _handle(line: bytes) -> dict:
    """One request line -> the answer: the agent started, or why not (the server itself goes on either way)."""
    try:
        request = json.loads(line)
        spec = request["spec"]
        missing = [key for key in _NEEDED if key not in spec]
        if missing:
            raise KeyError(", ".join(missing))
    except (ValueError, KeyError, TypeError) as error:
        return {"error": f"malformed launch request ({type(error).__name__}: {error}): {line[:200]!r}"}
    try:
        pid = _start_agent(spec)
    except OSError as error:  # fork failed: out of memory or processes
        return {"error": f"could not fork the torchrun agent: {error}"}
    agents.add(pid)
    return {"started": pid}


def _reap() -> None:
    for pid in list(agents):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            agents.discard(pid)
            _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _kill_all(*_) -> None:
    for pid in agents:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    os._exit(0)


def _preload() -> None:
    """Import, once, what nearly every worker needs: the point of this process. Nothing here starts a
    thread or touches CUDA, so forking afterwards stays safe."""
    import torch
    import torch.distributed.nn.functional  # before any group exists: see helpers/kit/distributed.py
    import torch.distributed.run
    import torch.nn.parallel
    import torch.optim

    # The first optimizer a process builds imports torch._dynamo: seconds in every worker, unless paid here.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    try:
        import torchvision  # noqa: F401
    except ImportError:
        pass


def main() -> None:
    from helpers.launcher.bootstrap import die_with_parent

    die_with_parent(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _kill_all)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the kernel handles interrupts and tells us
    _preload()
    import helpers.launcher.agent  # noqa: F401

    # Every object so far (torch's modules, mostly) goes to the collector's permanent generation. Otherwise
    # the first full collection in each forked agent and worker writes to the header of every one of them,
    # and copy-on-write turns about 80 MiB of pages shared with this process into private copies, per process.
    gc.freeze()

    _send({"ready": os.getpid()})
    buffer = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.02 if agents else 0.5)
        if readable:
            chunk = os.read(0, 65536)
            if not chunk:
                _kill_all()
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                _send(_handle(line))
        _reap()


if __name__ == "__main__":
    main()
