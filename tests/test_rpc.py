"""Lesson 05's library and the exercise's check. The RPC workers are launched, and asserted, by the lesson
(notebooks/05_rpc.ipynb, under pytest --nbval); here only what the lesson does not check: that the counter check says
"Correct" to the solution and "Not yet", naming the mistake, to each wrong variant. What launches nothing is tested
in tests/fast/test_rpc_no_launch.py. The check on the starting code and on the solution is asserted by the lesson
(nbval's Cells 27 and 28)."""
from __future__ import annotations

from pathlib import Path

import pytest

from helpers import WORKERS
from helpers.lessons.rpc import check_counter

SOLUTION = (WORKERS / "rpc_counter_solution.py").read_text()


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("LESSONS_DATA", "digits")


def _variant(tmp_path: Path, name: str, *replacements: tuple[str, str]) -> str:
    text = SOLUTION
    for old, new in replacements:
        assert old in text
        text = text.replace(old, new)
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_counter_check_catches_a_missing_lock(tmp_path, capsys):
    script = _variant(tmp_path, "no_lock.py", ("with self.lock:", "if True:"))
    assert not check_counter(script)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and "threading.Lock" in out and "one after another" not in out


def test_counter_check_catches_synchronous_calls(tmp_path, capsys):
    script = _variant(tmp_path, "sync.py", ("counter.rpc_async().add(1)", "counter.rpc_sync().add(1)"),
                      ("[future.wait() for future in futures]", "futures"))
    assert not check_counter(script)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and "one after another" in out and "Lock" not in out


def test_counter_check_catches_a_local_counter(tmp_path, capsys):
    script = _variant(tmp_path, "local.py", ('rpc.remote(f"worker{1 % world_size}", Counter)', "rpc.RRef(Counter())"))
    assert not check_counter(script)
    assert "create it on worker1" in capsys.readouterr().out
