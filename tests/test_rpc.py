"""Lesson 05's library and the exercise's check. The RPC workers are launched, and asserted, by the lesson
(notebooks/05_rpc.ipynb, under pytest --nbval); here only what the lesson does not check: that the counter check says
"Correct" to the solution and "Not yet", naming the mistake, to each wrong variant. What launches nothing is tested
in tests/fast/test_rpc_no_launch.py. The check on the starting code and on the solution is asserted by the lesson
(nbval's Cells 28 and 29)."""
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
    assert "Not yet: " in out and "threading.Lock" in out and "one after another" not in out


def test_counter_check_catches_synchronous_calls(tmp_path, capsys):
    script = _variant(tmp_path, "sync.py", ("counter.rpc_async().add(1)", "counter.rpc_sync().add(1)"),
                      ("[future.wait() for future in futures]", "futures"))
    assert not check_counter(script)
    out = capsys.readouterr().out
    assert "Not yet: " in out and "one after another" in out and "Lock" not in out


def test_counter_check_catches_a_local_counter(tmp_path, capsys):
    script = _variant(tmp_path, "local.py", ('rpc.remote(f"worker{1 % world_size}", Counter)', "rpc.RRef(Counter())"))
    assert not check_counter(script)
    assert "the counter was created on 'worker0': create it on worker1" in capsys.readouterr().out


def test_counter_check_catches_removed_sleeps(tmp_path, capsys):
    """A fresh reader's wrong answer (review 05-2): add()'s sleeps deleted, ten serial rpc_sync calls, no lock. Nothing
    overlapped and no lock was needed, so the count comes out right fast: the check must refuse it by the floor that
    the sleeps set, not say the calls ran at once."""
    script = _variant(tmp_path, "no_sleeps.py",
                      ("        time.sleep(0.1)  # slow work that may run in parallel with other calls\n", ""),
                      ("            time.sleep(0.01)\n", ""), ("with self.lock:", "if True:"),
                      ("counter.rpc_async().add(1)", "counter.rpc_sync().add(1)"),
                      ("[future.wait() for future in futures]", "futures"))
    assert not check_counter(script)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: ") and "keep both time.sleep lines in add()" in out, out
    assert "ran there at once" not in out, out


def test_counter_check_names_futures_waited_for_in_the_loop_that_sends_them(tmp_path, capsys):
    """Review 05-3: the lock is right, but each future is waited for as soon as it is sent; the hint must name the
    waiting, not the lock."""
    script = _variant(tmp_path, "wait_in_loop.py",
                      ("futures = [counter.rpc_async().add(1) for _ in range(10)]",
                       "futures = [counter.rpc_async().add(1).wait() for _ in range(10)]"),
                      ("[future.wait() for future in futures]", "futures"))
    assert not check_counter(script)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: ") and "waited for in the same loop that sends it" in out, out
    assert "is your lock held" not in out, out


def test_counter_check_names_a_copy_fetched_with_to_here(tmp_path, capsys):
    """Review 05-3: counter.to_here() then local calls: the copy's where() reports worker1 (its constructor ran
    there), so the owner check alone passes it; the hint must name the copy. (No lock: a lock cannot be pickled.)"""
    script = _variant(tmp_path, "to_here_copy.py", ("with self.lock:", "if True:"),
                      ("self.lock = threading.Lock()", "self.lock = None"),
                      ("futures = [counter.rpc_async().add(1) for _ in range(10)]",
                       "local = counter.to_here()\n        futures = [local.add(1) for _ in range(10)]"),
                      ("[future.wait() for future in futures]", "futures"),
                      ("owner=counter.rpc_sync().where()", "owner=local.where()"))
    assert not check_counter(script)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: ") and "counter.to_here() copies the Counter to worker0" in out, out


def test_counter_check_blames_a_lock_held_during_the_slow_work(tmp_path, capsys):
    """The walkthrough's third try: the lock around all of add() serializes the calls again, although they were sent
    with rpc_async; the hint must name the lock, not the sending."""
    script = _variant(tmp_path, "big_lock.py",
                      ("        time.sleep(0.1)  # slow work that may run in parallel with other calls\n"
                       "        with self.lock:", "        with self.lock:\n            time.sleep(0.1)"))
    assert not check_counter(script)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: ") and "is your lock held during add()'s slow 0.1 s sleep?" in out, out
    assert "threading.Lock" not in out and "created on" not in out, out


def test_counter_check_names_the_learners_line_when_a_call_fails(tmp_path, capsys):
    """A typo in a remote method's name: the RRef's proxy looks the method up when the call arrives, and the error
    is raised on worker0 where the future is waited for; the message must name that line of the learner's file."""
    script = _variant(tmp_path, "typo.py", ("counter.rpc_async().add(1)", "counter.rpc_async().ad(1)"))
    line = next(number for number, text in enumerate(Path(script).read_text().splitlines(), 1)
                if "future.wait()" in text)
    assert not check_counter(script)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith(f"Not yet: typo.py crashed on rank 0 at typo.py:{line} "), out
    assert "AttributeError" in out and "'ad'" in out and "rank<N>.log" in out, out


NO_RREF_MAIN = '''_counter = None


def make() -> None:  # a module-level Counter on worker1: no RRef anywhere
    global _counter
    _counter = Counter()


def call(method: str, *args):
    return getattr(_counter, method)(*args)


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        rpc.rpc_sync("worker1", make)
        started = time.perf_counter()
        futures = [rpc.rpc_async("worker1", call, args=("add", 1)) for _ in range(10)]
        partial_counts = [future.wait() for future in futures]
        seconds = time.perf_counter() - started
        result(count=rpc.rpc_sync("worker1", call, args=("value",)),
               owner=rpc.rpc_sync("worker1", call, args=("where",)), partial_counts=sorted(partial_counts),
               seconds=seconds)
    rpc.shutdown()
'''


def test_counter_check_requires_an_rref(tmp_path, capsys):
    """Review r0506-2, 05-1: the Counter made on worker1 by a plain rpc_sync and reached through module functions;
    owner, count and timing are all right, so only the RRef requirement can refuse it (it used to get "Correct")."""
    start, end = SOLUTION.index("def main() -> None:"), SOLUTION.index('if __name__ == "__main__":')
    path = tmp_path / "no_rref.py"
    path.write_text(SOLUTION[:start] + NO_RREF_MAIN + "\n\n" + SOLUTION[end:])
    assert not check_counter(str(path))
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: the counter lives on worker1, but no RRef holds it: create it with "), out
    assert "rpc.remote(\"worker1\", Counter)" in out, out
    assert "Lock" not in out and "one after another" not in out, out


def test_counter_check_says_when_the_file_is_missing(tmp_path, capsys):
    assert not check_counter(tmp_path / "my_counter.py")
    assert "my_counter.py does not exist yet: run the %%writefile cell" in capsys.readouterr().out
