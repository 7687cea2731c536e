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

from helpers.kit import REPO_ROOT
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


class LaunchServer:
    """The kernel's handle on helpers/launcher/server.py (started once, on first use)."""

    instance: LaunchServer | None = None

    command = (sys.executable, "-m", "helpers.launcher.server")
    ready_timeout = 120.0  # seconds for the server to import torch and say "ready"; slow disks take tens of seconds

    def __init__(self) -> None:
        started = time.perf_counter()
        self.proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     start_new_session=True, env=child_env())
        self.buffer = b""
        self.exit_codes: dict[int, int] = {}
        try:
            self._read_until(("ready",), timeout=self.ready_timeout)
        except BaseException:  # not ready in time, or interrupted: leave no half-started server behind
            self.proc.kill()
            self.proc.wait()
            raise
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

    def _read_until(self, keys: tuple[str, ...], timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for message in self._messages(0.1):
                if any(key in message for key in keys):
                    return message
        raise RuntimeError(f"the launch server did not answer '{keys[0]}' within {timeout:g} s")

    def request(self, line: bytes) -> dict:
        """Send one request line; the server's answer: {"started": pid} or {"error": why}."""
        self.proc.stdin.write(line + b"\n")
        self.proc.stdin.flush()
        return self._read_until(("started", "error"), timeout=30)

    def start(self, spec: dict) -> int:
        answer = self.request(json.dumps({"spec": spec}).encode())
        if "error" in answer:
            raise RuntimeError(f"the launch server could not start this launch: {answer['error']}")
        return answer["started"]

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
