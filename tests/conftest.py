"""Fixtures shared by the tests: launches run in a temporary folder and leave no process behind."""
from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from helpers.launcher.run_folder import alive, registered_pids


@pytest.fixture(autouse=True, scope="session")
def _runs_outside_the_repository(tmp_path_factory):
    """Run folders of every launch go to a temporary folder: tests never write into the repository."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HELPERS_RUNS_DIR", str(tmp_path_factory.mktemp("runs")))
        yield


@pytest.fixture
def in_tmp(tmp_path, monkeypatch) -> Path:
    """Run the test in its own empty working directory."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


class Processes:
    """What a test asks about the processes of a run."""

    worker_pids = staticmethod(registered_pids)
    alive = staticmethod(alive)

    def nothing_left(self, log_dir: Path) -> None:
        """No worker of this run and no agent under the launch server is still running."""
        from helpers.launcher.processes import LaunchServer

        pids = self.worker_pids(log_dir)
        assert pids, "the run registered no workers"
        assert not [pid for pid in pids if self.alive(pid)], "workers outlived the launch"
        server = LaunchServer.instance
        if server is not None and server.proc.poll() is None:
            left = [p for p in psutil.Process(server.proc.pid).children(recursive=True) if p.status() != "zombie"]
            assert not left, f"processes left under the launch server: {left}"


@pytest.fixture
def processes() -> Processes:
    return Processes()
