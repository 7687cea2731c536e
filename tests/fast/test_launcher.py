"""The launcher's parts that need no launch: argument checks, the %%torchrun options, the console's echo, the launch
server's answers to bad requests, its readiness timeout, and what a worker pays for importing the kit."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest

from helpers import REPO_ROOT, launch
from helpers.launcher import api, magic, server
from helpers.launcher.console import Echo
from helpers.launcher.processes import LaunchServer
from helpers.launcher.spec import worker_env

ALLREDUCE = REPO_ROOT / "helpers" / "workers" / "allreduce_demo.py"


@pytest.mark.parametrize("kwargs, error, words", [
    ({"nproc": 0}, ValueError, "nproc must be a whole number >= 1"),
    ({"script": "no_such_script.py"}, FileNotFoundError, "worker script not found: no_such_script.py"),
    ({"nprocs": 2}, TypeError, "unknown launch option(s) nprocs"),
    ({"timeout": -1}, ValueError, "timeout must be a positive"),
    ({"max_restarts": -2}, ValueError, "max_restarts must be"),
])
def test_bad_arguments_fail_at_once_before_any_process(kwargs, error, words):
    arguments = {"script": ALLREDUCE, **kwargs}
    before = set(psutil.Process().children(recursive=True))
    started = time.perf_counter()
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        launch(**arguments)
    assert time.perf_counter() - started < 0.5
    assert set(psutil.Process().children(recursive=True)) <= before


def test_unsupported_systems_fail_at_once_with_a_clear_message(monkeypatch):
    monkeypatch.setattr(os, "name", "nt")
    with pytest.raises(OSError, match=r"Linux and macOS only.*WSL2"):
        launch(ALLREDUCE, nproc=2)


@pytest.mark.parametrize("cpus, omp, nproc, expected", [
    (None, None, 2, "1"),  # no budget: one thread per worker, as torchrun sets it
    (None, None, 1, None),  # no budget, one worker: torch's own default
    ("4", None, 2, "2"),  # a budget of 4 CPUs for 2 workers
    ("3", None, 4, "1"),  # never below one thread
    ("4", "3", 2, "3"),  # the caller's OMP_NUM_THREADS wins
])
def test_workshop_cpu_budget_sets_threads_per_worker(monkeypatch, tmp_path, cpus, omp, nproc, expected):
    for name, value in (("LESSONS_CPUS", cpus), ("OMP_NUM_THREADS", omp)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert worker_env(tmp_path, 0, nproc).get("OMP_NUM_THREADS") == expected


def test_a_worker_importing_the_kits_reporting_pays_for_nothing_else():
    code = ("import sys; from helpers.kit.reporting import result; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('helpers', 'psutil', 'torch', 'IPython')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "['helpers', 'helpers.kit', 'helpers.kit.reporting', 'helpers.kit.run_files']"


def test_values_json_cannot_hold_travel_as_text(tmp_path, monkeypatch):
    """A dtype or a set handed to result() must not crash the worker that reports it."""
    code = ("import torch; from helpers.kit.reporting import result; "
            "result(dtype=torch.float16, seen={3, 1}, device=torch.device('cpu'), shape=torch.Size([2, 3]))")
    env = {**os.environ, "HELPERS_RUN_DIR": str(tmp_path), "RANK": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)
    (events,) = (tmp_path / "events").iterdir()
    values = json.loads(events.read_text())["values"]
    assert values == {"dtype": "torch.float16", "seen": [1, 3], "device": "cpu", "shape": [2, 3]}


# ---------------------------------------------------------------------------- the console

def _echoed(limit, *batches) -> list[str]:
    import io
    from contextlib import redirect_stdout

    out = io.StringIO()
    echo = Echo(limit, "runs/x/rank<N>.log")
    with redirect_stdout(out):
        for batch in batches:
            echo.show([(i % 2, "stdout", text) for i, text in enumerate(batch)])
    return out.getvalue().splitlines()


def test_echo_prints_labelled_lines_up_to_its_limit(capsys):
    echo = Echo(2, "runs/x/rank<N>.log")
    echo.show([(0, "stdout", "a"), (1, "stderr", "b"), (0, "stdout", "c")])
    echo.show([(0, "stdout", "d")])
    shown = capsys.readouterr().out.splitlines()
    assert [line.split("]", 1)[0][-6:] for line in shown[:2]] == ["rank 0", "rank 1"]
    assert shown[0].endswith(" a") and "\x1b[31mb" in shown[1]  # stderr in red
    assert len(shown) == 3 and "not shown live (echo=2)" in shown[2] and "runs/x/rank<N>.log" in shown[2]


def test_echo_says_more_output_only_when_a_line_was_left_out():
    assert not any("not shown live" in line for line in _echoed(2, ["a", "b"]))  # exactly the limit: all shown
    assert not any("not shown live" in line for line in _echoed(2, ["a"], ["b"]))
    late = _echoed(2, ["a", "b"], ["c"], ["d"])  # the first line left out comes in a later batch: said once, then
    assert len(late) == 3 and "not shown live" in late[2]
    assert len(_echoed(True, [str(i) for i in range(500)])) == 500  # echo=True: every line, no note
    assert _echoed(False, ["a", "b"]) == []


# ---------------------------------------------------------------------------- %%torchrun's options

def test_every_torchrun_option_reaches_launch(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(magic, "launch", lambda path, **kwargs: calls.append((path, kwargs)) or "a run")
    namespace: dict = {}
    magic.run_cell("-n 3 --timeout 5 --max-restarts 1 --fresh --debug --name mine --out answer -- --steps 4",
                   "print('hi')\n", namespace)
    path, kwargs = calls[0]
    assert str(path) == os.path.join("runs", "cells", "mine.py") and (tmp_path / path).read_text() == "print('hi')\n"
    assert kwargs == {"nproc": 3, "args": ["--steps", "4"], "timeout": 5.0, "max_restarts": 1, "fresh": True,
                      "debug": True}
    assert namespace == {"answer": "a run"}


def test_torchrun_without_fresh_leaves_the_platform_default(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    calls = []
    monkeypatch.setattr(magic, "launch", lambda path, **kwargs: calls.append(kwargs))
    magic.run_cell("-n 2", "pass\n", {})
    assert calls[0]["fresh"] is None and calls[0]["debug"] is False and calls[0]["timeout"] is None
    for fork_safe, fresh in ((True, False), (False, True)):  # Linux forks; macOS starts fresh interpreters
        monkeypatch.setattr(api, "_FORK_SAFE", fork_safe)
        assert api.fresh_or_default(None) is fresh
        assert api.fresh_or_default(True) is True and api.fresh_or_default(False) is False


@pytest.mark.parametrize("line, words", [("-n 2 --bogus", "unknown option"), ("-n two", "invalid int value")])
def test_torchrun_refuses_a_bad_line(line, words):
    with pytest.raises(ValueError, match=words):
        magic.parse_line(line)


# ---------------------------------------------------------------------------- the launch server

def test_the_server_answers_a_malformed_request_with_an_error():
    for line, words in ((b"not json", "malformed launch request (JSONDecodeError"),
                        (b'{"no spec": 1}', "malformed launch request (KeyError: 'spec')"),
                        (b'{"spec": {"run_dir": "x"}}', "KeyError: 'node_rank, cwd, env'"),
                        (b'["spec"]', "malformed launch request (TypeError")):
        answer = server._handle(line)
        assert list(answer) == ["error"] and words in answer["error"], (line, answer)
    assert not server.agents


def test_a_failed_fork_is_an_error_for_that_launch_only(monkeypatch):
    def no_fork():
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(os, "fork", no_fork)
    spec = {"run_dir": "x", "node_rank": 0, "cwd": ".", "env": {}}
    answer = server._handle(json.dumps({"spec": spec}).encode())
    assert answer == {"error": "could not fork the torchrun agent: [Errno 12] Cannot allocate memory"}
    assert not server.agents


def test_a_server_that_never_gets_ready_is_stopped_with_a_clear_error(monkeypatch):
    class Silent(LaunchServer):
        command = (sys.executable, "-c", "import time; time.sleep(60)")
        ready_timeout = 0.5

    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"did not answer 'ready' within 0.5 s") as caught:
        Silent()
    assert time.monotonic() - started < 10
    leftover = [p for p in psutil.Process().children() if "time.sleep(60)" in " ".join(p.cmdline())]
    assert not leftover, caught.value


def test_echo_shortens_the_paths_in_a_rank_s_traceback(capsys):
    """A rank's traceback, echoed live, names the repository's files relative to its root and torch's from
    site-packages, as the launcher's own error does; other lines and stdout are printed as they came."""
    from helpers.kit import REPO_ROOT
    from helpers.launcher.console import Echo

    echo = Echo(True, "runs/x/rank<N>.log")
    echo.show([(1, "stderr", f'  File "{REPO_ROOT}/helpers/workers/demo.py", line 3, in main'),
               (1, "stderr", '  File "/opt/venv/lib/python3.11/site-packages/torch/_tensor.py", line 9, in backward'),
               (0, "stdout", f"saved to {REPO_ROOT}/runs/x")])
    out = capsys.readouterr().out
    assert 'File "helpers/workers/demo.py", line 3' in out and str(REPO_ROOT) + "/helpers" not in out
    assert 'File ".../site-packages/torch/_tensor.py", line 9' in out and "/opt/venv" not in out
    assert f"saved to {REPO_ROOT}/runs/x" in out
