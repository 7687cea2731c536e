"""Live ranks (%ranks, %%ranks) with real torchrun agents and workers: one test per thing a learner meets (issue 37).
The tests share one IPython shell and, while they leave it usable, one group of 2 ranks."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from helpers.launcher import live
from helpers.launcher.api import WorkerFailed
from helpers.launcher.live_text import RESTART, CellFailed, CellInterrupted, CellTimeout, RanksUnavailable
from helpers.launcher.run_folder import rank_log

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def shell(tmp_path_factory):
    """An IPython shell with %load_ext helpers, working in an empty folder; its ranks are stopped afterwards."""
    from IPython.testing.globalipapp import get_ipython

    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp_path_factory.mktemp("live"))
        shell = get_ipython()
        shell.run_line_magic("load_ext", "helpers")
        yield shell
        live.stop()


@pytest.fixture
def ranks(shell):
    """The shell, with 2 live ranks running (started once, and again only after a test broke or stopped them)."""
    session = live.LiveRanks.session
    if session is None or session.gone or session.busy:
        shell.run_line_magic("ranks", "start -n 2")
    return shell


def cell(shell, source: str, line: str = ""):
    """Run `source` as a %%ranks cell: its lines are numbered from 2, the %%ranks line being line 1."""
    return shell.run_cell_magic("ranks", line, textwrap.dedent(source))


class TimedStdout:
    """Stands in for sys.stdout: every line written, without colours, with the time it was written."""

    def __init__(self) -> None:
        self.lines: list[tuple[float, str]] = []

    def write(self, text: str) -> int:
        self.lines += [(time.monotonic(), ANSI.sub("", line)) for line in text.splitlines() if line]
        return len(text)

    def flush(self) -> None:
        pass

    def text(self) -> list[str]:
        return [line for _, line in self.lines]


def interrupt_when(session: live.LiveRanks, said: dict[int, str]) -> dict[str, float]:
    """From a thread: once each rank in `said` has printed its line (so each has reached the spot where it waits),
    SIGINT this process, as ■ Stop does to a kernel. Returns {"sent": when} once sent.

    SIGINT raises KeyboardInterrupt here, as in a kernel, even when pytest was started in the background by a shell
    (`nohup ... &`), which leaves SIGINT ignored (test_launch.py does the same)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sent: dict[str, float] = {}

    def watch() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            logs = {rank: Path(rank_log(session.job.run_dir, rank)) for rank in said}
            if all(path.exists() and said[rank] in path.read_text() for rank, path in logs.items()):
                time.sleep(0.3)  # from the print to the wait is a few bytecodes
                sent["sent"] = time.monotonic()
                signal.raise_signal(signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    return sent


def test_output_is_labelled_by_rank_and_shown_live(ranks, monkeypatch):
    out = TimedStdout()
    monkeypatch.setattr(sys, "stdout", out)
    cell(ranks, "print(f'hello from rank {rank} of {world_size}')")
    assert out.text() == ["[rank 0] hello from rank 0 of 2", "[rank 1] hello from rank 1 of 2"]
    out.lines.clear()
    cell(ranks, """
        import time
        print('before the wait', flush=True)
        time.sleep(2.5)
        print('after the wait')
    """)
    ended = time.monotonic()
    shown = {line: when for when, line in out.lines}
    for rank in (0, 1):
        assert ended - shown[f"[rank {rank}] before the wait"] > 1.5, "the first line waited for the cell to end"
        assert f"[rank {rank}] after the wait" in shown


def test_each_rank_keeps_its_own_variables_and_values_come_back_as_per_rank_lists(ranks, capsys):
    cell(ranks, """
        x = torch.ones(2) * (dist.get_rank() + 1)
        dist.all_reduce(x)
    """)
    assert [t.tolist() for t in ranks.run_line_magic("ranks", "get x")] == [[3.0, 3.0], [3.0, 3.0]]  # 1 + 2
    assert cell(ranks, "y = x * 10 * rank\nprint(y)", "1") is None
    assert ANSI.sub("", capsys.readouterr().out).splitlines()[-1] == "[rank 1] tensor([30., 30.])"
    assert cell(ranks, "rank * 100") == [0, 100]  # the last expression, a list indexed by rank
    assert cell(ranks, "y.sum().item()", "1") == {1: 60.0}  # one rank: keyed by rank
    assert ranks.run_line_magic("ranks", "get 'y' in globals()") == [False, True]  # y lives on rank 1 only


def test_an_error_names_the_rank_and_the_cells_line_and_every_rank_keeps_its_state(ranks):
    cell(ranks, "kept = rank + 7")
    with pytest.raises(CellFailed) as caught:
        cell(ranks, """\
            before = 1
            if rank == 1:
                raise ValueError('rank 1 broke on purpose')
            after = 2
        """)
    failure = caught.value
    assert failure.rank == 1 and failure.where.startswith("In[") and failure.where.endswith(":4 (in <module>)")
    assert failure.error == "ValueError: rank 1 broke on purpose"
    message = str(failure)
    assert message.startswith(f"rank 1 failed at {failure.where}: ValueError: rank 1 broke on purpose")
    assert "rank 0 finished the cell." in message and "Every rank keeps its variables" in message
    assert "    raise ValueError('rank 1 broke on purpose')" in message  # the cell's own source line
    assert "live_rank.py" not in message and "bootstrap" not in message
    assert ranks.run_line_magic("ranks", "get (kept, before, 'after' in globals())") == [(7, 1, True), (8, 1, False)]
    x = torch_sum_of_ranks(ranks)
    assert x == [1.0, 1.0], "the process group works after the error"


def torch_sum_of_ranks(shell) -> list[float]:
    return cell(shell, "s = torch.tensor([float(rank)])\ndist.all_reduce(s)\ns.item()")


def test_stop_interrupts_a_python_wait_and_the_ranks_stay_usable(ranks):
    cell(ranks, "kept = rank + 7")
    sent = interrupt_when(live.LiveRanks.session, {0: "waiting", 1: "waiting"})
    with pytest.raises(CellInterrupted) as caught:
        cell(ranks, "import time\nprint('waiting', flush=True)\ntime.sleep(60)", "--timeout 90")  # not a hang
    elapsed = time.monotonic() - sent["sent"]
    stopped = caught.value
    assert isinstance(stopped, KeyboardInterrupt) and not stopped.stuck
    assert set(stopped.where) == {0, 1} and all(re.fullmatch(r"in time\.sleep at In\[\d+\]:4", where)
                                                for where in stopped.where.values()), stopped.where
    assert "ready for the next cell" in str(stopped)
    assert elapsed < 1.0, f"the cell ended {elapsed:.2f} s after the interrupt"
    assert ranks.run_line_magic("ranks", "get kept") == [7, 8]
    assert torch_sum_of_ranks(ranks) == [1.0, 1.0]
    started = time.monotonic()
    with pytest.raises(CellTimeout, match=r"Timed out after 1 s\.") as caught:  # --timeout: the same, unattended
        cell(ranks, "import time\ntime.sleep(60)", "--timeout 1")
    assert time.monotonic() - started < 3 and not caught.value.stuck
    assert ranks.run_line_magic("ranks", "get kept") == [7, 8]


def test_stop_during_a_collective_one_rank_never_joins_says_where_and_restart_brings_the_group_back(ranks):
    sent = interrupt_when(live.LiveRanks.session, {0: "joining", 1: "not joining"})
    with pytest.raises(CellInterrupted) as caught:
        cell(ranks, """\
            if rank == 0:
                print('joining', flush=True)
                dist.all_reduce(torch.ones(1))
            else:
                print('not joining')
        """, "--timeout 90")  # if the interrupt never came: a failure, not a hang of the whole suite
    elapsed = time.monotonic() - sent["sent"]
    stopped = caught.value
    assert stopped.stuck == {0}
    assert re.fullmatch(r"waiting in dist\.all_reduce at In\[\d+\]:4", stopped.where[0]), stopped.where
    message = str(stopped)
    assert f"rank 0: {stopped.where[0]}; still there" in message and "rank 1: had finished the cell" in message
    assert "The process group is broken" in message and "%ranks restart" in message
    assert elapsed < 1.0, f"the cell ended {elapsed:.2f} s after the interrupt"
    with pytest.raises(RanksUnavailable, match=r"(?s)broken.*rank 0: waiting in dist\.all_reduce.*%ranks restart"):
        cell(ranks, "print('anyone there?')")
    old = live.LiveRanks.session.job.run_dir
    ranks.run_line_magic("ranks", "restart")
    assert live.LiveRanks.session.job.run_dir != old
    assert torch_sum_of_ranks(ranks) == [1.0, 1.0]
    assert ranks.run_line_magic("ranks", "get 'kept' in globals()") == [False, False], "a restart starts afresh"


def test_a_dead_rank_is_named_with_its_exit_code_and_stack_and_restart_brings_the_group_back(ranks, processes):
    run_dir = live.LiveRanks.session.job.run_dir
    with pytest.raises(WorkerFailed) as caught:
        cell(ranks, """\
            import ctypes
            def crash():
                return ctypes.string_at(0)
            crash()
        """, "1")
    failure = caught.value
    assert failure.rank == 1 and failure.exitcode == -signal.SIGSEGV
    assert re.fullmatch(r"In\[\d+\]:4 \(in crash\)", failure.where), failure.where
    message = str(failure)
    assert message.startswith("rank 1 failed first, with exit code -11 (SIGSEGV)")
    assert "    return ctypes.string_at(0)" in message and "Fatal Python error: Segmentation fault" in message
    assert message.endswith(RESTART)
    processes.nothing_left(run_dir)
    with pytest.raises(RanksUnavailable, match="a rank died"):
        cell(ranks, "print(1)")
    ranks.run_line_magic("ranks", "restart")
    assert torch_sum_of_ranks(ranks) == [1.0, 1.0]


KERNEL = textwrap.dedent("""
    from helpers.launcher import live
    session = live.start(2)
    print("ranks at", session.job.run_dir, flush=True)
    session.run("import time\\nprint('sleeping', flush=True)\\ntime.sleep(120)")
""")


def test_a_killed_kernel_leaves_nothing_running(tmp_path, processes):
    """As tests/test_launch.py::test_killed_kernel_leaves_no_worker_alive: a process standing in for the kernel is
    SIGKILLed (what a kernel restart comes to when the kernel does not exit in time) while its ranks run a cell (in
    time.sleep, where only the launcher's process-group kill reaches them; an idle rank also sees its socket close)."""
    proc = subprocess.Popen([sys.executable, "-c", KERNEL], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    try:
        said = ""
        while "ranks at " not in said:
            said = proc.stdout.readline()
            assert said, "the stand-in kernel ended before its ranks started"
        run_dir = Path(said.split("ranks at ", 1)[1].strip())
        deadline = time.monotonic() + 60
        while not all(Path(rank_log(run_dir, r)).exists() and "sleeping" in Path(rank_log(run_dir, r)).read_text()
                      for r in (0, 1)):
            assert time.monotonic() < deadline, "the cell did not start"
            time.sleep(0.1)
        pids = processes.worker_pids(run_dir)
        family = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
        assert len(pids) == 2 and len(family) >= 4, "a launch server, an agent and two ranks"
    finally:
        proc.kill()
        proc.wait()
    killed = time.monotonic()
    while any(processes.alive(pid) for pid in pids + family):
        assert time.monotonic() - killed < 5, "processes outlived the killed kernel"
        time.sleep(0.05)
