"""The notebook kernel's handles on the processes a launch starts: the launch server and each agent.

A torchrun agent runs in a process of its own, the leader of its process group, so that one signal
reaches the agent and every worker it forked. By default the agent is forked by the launch server
(helpers/launcher/server.py), which has imported torch once; ``fresh`` agents are new interpreters, as a
terminal torchrun starts them.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time

from helpers import REPO_ROOT
from helpers.launcher import run_folder


def free_port() -> int:
    """A TCP port on loopback that is free right now (for an explicit rdzv_endpoint)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def child_env() -> dict[str, str]:
    """The kernel's environment, plus the repository on PYTHONPATH and unbuffered output."""
    env = dict(os.environ)
    root = str(REPO_ROOT)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def stop_launch_server_for(what: str) -> bool:
    """Stop this kernel's launch server before `what` imports torch afresh (a spawned or fresh interpreter), so
    that the server's copy of torch and the new one do not add up in memory; say so when it was running.
    Any launch still running under it is killed with it (server.py: every agent group dies when its input closes).
    The next launch starts a new server (a second or two). Returns whether one was running."""
    if LaunchServer.stop() is None:
        return False
    print(f"(This kernel's launch server was stopped first, so that it and {what} do not add up in memory; the next "
          "launch starts a new one.)")
    return True


class LaunchServer:
    """The kernel's handle on helpers/launcher/server.py (started once, on first use)."""

    instance: LaunchServer | None = None

    def __init__(self) -> None:
        started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "helpers.launcher.server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, start_new_session=True, env=child_env())
        self.buffer = b""
        self.exit_codes: dict[int, int] = {}
        self._read_until("ready", timeout=120)
        self.start_time = time.perf_counter() - started

    @classmethod
    def running(cls) -> bool:
        return cls.instance is not None and cls.instance.proc.poll() is None

    @classmethod
    def stop(cls, timeout: float = 30) -> int | None:
        """Stop the running server (it exits when its input closes, server.py's main); return its exit code, or None
        when none was running. The next launch starts a new one."""
        if not cls.running():
            return None
        cls.instance.proc.stdin.close()
        return cls.instance.proc.wait(timeout=timeout)

    @classmethod
    def get(cls) -> tuple[LaunchServer, float]:
        """The running server and how long this call spent starting it (0 when already up)."""
        if cls.instance is None or cls.instance.proc.poll() is not None:
            cls.instance = cls()
            return cls.instance, cls.instance.start_time
        return cls.instance, 0.0

    def _messages(self, timeout: float) -> list[dict]:
        fd = self.proc.stdout.fileno()
        if select.select([fd], [], [], timeout)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError("the launch server exited unexpectedly; run the cell again")
            self.buffer += chunk
        lines = self.buffer.split(b"\n")
        self.buffer = lines.pop()
        messages = [json.loads(line) for line in lines if line.strip()]
        for message in messages:
            if "exited" in message:
                self.exit_codes[message["exited"]] = message["code"]
        return messages

    def _read_until(self, key: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self._messages(0.1):
                if key in message:
                    return message
        raise RuntimeError(f"the launch server did not answer '{key}' within {timeout:.0f} s")

    def start(self, spec: dict) -> int:
        self.proc.stdin.write((json.dumps({"spec": spec}) + "\n").encode())
        self.proc.stdin.flush()
        return self._read_until("started", timeout=30)["started"]

    def poll(self, pid: int) -> int | None:
        self._messages(0)
        return self.exit_codes.pop(pid, None)


class Agent:
    """One torchrun agent process (a process-group leader), forked by the server or fresh."""

    def __init__(self, spec: dict) -> None:
        run_dir, node = spec["run_dir"], spec["node_rank"]
        self.server: LaunchServer | None = None
        self.popen: subprocess.Popen | None = None
        self.server_start, self.server_lost, self._pidfd = 0.0, False, None
        if spec["fresh"]:
            spec_path = run_folder.node_file(run_dir, "spec", node)
            run_folder.write_json(spec_path, spec)
            with open(run_folder.node_file(run_dir, "agent_log", node), "ab") as log:
                self.popen = subprocess.Popen([sys.executable, "-m", "helpers.launcher.agent", spec_path],
                                              stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                              start_new_session=True, env=spec["env"], cwd=spec["cwd"])
            self.pid = self.popen.pid
            self._pidfd = os.pidfd_open(self.pid) if hasattr(os, "pidfd_open") else None
        else:
            self.server, self.server_start = LaunchServer.get()
            self.pid = self.server.start(spec)
        self.code: int | None = None

    def poll(self) -> int | None:
        """The agent's exit code, None while it runs. A dead server leaves no code: the agent died with it
        (PR_SET_PDEATHSIG), and `server_lost` says so."""
        if self.code is None:
            if self.popen is not None:
                self.code = self.popen.poll()
                if self.code is not None and self._pidfd is not None:
                    os.close(self._pidfd)
                    self._pidfd = None
                return self.code
            try:
                if self.server.proc.poll() is None:
                    self.code = self.server.poll(self.pid)
                    return self.code
            except RuntimeError:  # the server's pipe closed: it is exiting
                pass
            self.server_lost = True
            if not run_folder.alive(self.pid):
                self.code = -int(signal.SIGKILL)
        return self.code

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def sleep_until_news(agents: list[Agent], seconds: float) -> None:
    """Sleep up to `seconds`, waking at once when an agent exits (the server's message, or a pidfd)."""
    fds = set()
    for agent in agents:
        if agent.code is None and agent.server is not None and agent.server.proc.poll() is None:
            fds.add(agent.server.proc.stdout.fileno())
        elif agent.code is None and agent._pidfd is not None:
            fds.add(agent._pidfd)
    if fds:
        select.select(list(fds), [], [], seconds)
    else:
        time.sleep(seconds)
