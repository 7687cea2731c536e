"""Live ranks without a launch: the wire's framing, how a rank runs a cell (values, errors and their lines, an
interrupt), and the kernel side's pure rules (rank lists, messages, a dead rank's stack, the %ranks command line)."""
from __future__ import annotations

import os
import pickle
import signal
import socket
import threading
import time

import pytest
import torch

from helpers.kit import live_wire
from helpers.launcher import diagnosis, live, live_rank, live_text, magic
from helpers.launcher.api import WorkerFailed

# ---------------------------------------------------------------------------- the wire


def test_messages_survive_any_split_of_the_byte_stream():
    sent = [({"op": "run", "cell": 1, "source": "print('é')"}, b""),
            ({"cell": 1, "value": "pickle"}, bytes(range(256))), ({"op": "exit"}, b"")]
    stream = b"".join(live_wire.frame(header, blob) for header, blob in sent)
    for piece in (1, 3, 7, len(stream)):
        reader, got = live_wire.Reader(), []
        for start in range(0, len(stream), piece):
            got += reader.feed(stream[start:start + piece])
        assert got == sent, piece
        assert not reader.buffer


def test_a_stream_that_is_not_ours_is_refused():
    with pytest.raises(ValueError, match="not a live-rank stream"):
        live_wire.Reader().feed(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")


def test_receive_blocks_for_a_whole_message_and_says_when_the_other_end_left():
    left, right = socket.socketpair()
    with left, right:
        data = live_wire.frame({"a": 1}, b"xyz") + live_wire.frame({"b": 2})
        left.sendall(data[:5])
        left.sendall(data[5:])
        reader, pending = live_wire.Reader(), []
        assert live_wire.receive(right, reader, pending) == ({"a": 1}, b"xyz")
        assert live_wire.receive(right, reader, pending) == ({"b": 2}, b"")
        left.close()
        with pytest.raises(live_wire.Closed):
            live_wire.receive(right, reader, pending)


# ---------------------------------------------------------------------------- a cell on one rank


@pytest.fixture
def namespace():
    return live_rank.new_namespace(1, 2, torch.device("cpu"))


def test_a_cell_returns_its_last_expression_as_ipython_does(namespace):
    assert live_rank.execute("x = torch.ones(2) * (rank + 1)", "In[1]", namespace) == ({"status": "ok", "value": None},
                                                                                        b"")
    header, blob = live_rank.execute("x.sum()", "In[2]", namespace)
    assert header["status"] == "ok" and header["repr"] == "tensor(4.)"
    assert torch.equal(live_text.unpack(header, blob), torch.tensor(4.0))
    assert live_rank.execute("x.sum();", "In[3]", namespace)[0]["value"] is None  # a semicolon hides it
    assert live_rank.execute("world_size", "In[4]", namespace)[0]["repr"] == "2"


def test_an_error_points_at_the_cells_own_lines(namespace):
    live_rank.execute("def f(v):\n    return 1 / v\n", "In[5]", namespace)
    header, _ = live_rank.execute("a = 1\nb = f(0)\n", "In[6]", namespace)
    assert header["status"] == "error" and header["error"] == "ZeroDivisionError: division by zero"
    assert header["where"] == "In[5]:2 (in f)"  # the innermost cell line: the function, in the cell that defined it
    text = header["traceback"]
    assert 'File "In[6]", line 2, in <module>\n    b = f(0)' in text
    assert 'File "In[5]", line 2, in f\n    return 1 / v' in text
    assert "live_rank.py" not in text and "exec(" not in text
    assert namespace["a"] == 1 and "b" not in namespace  # the lines before the error ran


def test_a_syntax_error_names_the_cell_line(namespace):
    header, _ = live_rank.execute("a = 1\nb = (\n", "In[7]", namespace)
    assert header["status"] == "error" and header["where"] == "In[7]:2" and "SyntaxError" in header["error"]
    assert "a" not in namespace


def test_system_exit_ends_the_rank_as_in_a_script(namespace):
    with pytest.raises(SystemExit):
        live_rank.execute("import sys\nsys.exit(3)", "In[8]", namespace)


def test_sigint_interrupts_a_running_cell_and_is_ignored_between_cells(namespace):
    previous = signal.signal(signal.SIGINT, live_rank._interrupt)
    try:
        os.kill(os.getpid(), signal.SIGINT)  # between cells: ignored
        started = time.monotonic()
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()  # the kernel's SIGINT, mid-cell
        header, _ = live_rank.execute("import time\nprint('sleeping')\ntime.sleep(30)", "In[9]", namespace)
        assert time.monotonic() - started < 10
        assert header["status"] == "interrupted" and header["where"] == "In[9]:3 (in <module>)"
        assert not live_rank._interruptible
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_value_that_cannot_travel_comes_back_as_its_repr(namespace):
    header, blob = live_rank.execute("(v for v in range(3))", "In[10]", namespace)
    value = live_text.unpack(header, blob)
    assert isinstance(value, live_text.RemoteRepr) and repr(value).startswith("<generator object")
    assert "pickle" in value.why
    broken = {"value": "pickle", "repr": "Thing()"}  # pickles on the rank, not here (a class only the rank has)
    assert repr(live_text.unpack(broken, pickle.dumps(1)[:-3])) == "Thing()"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_tensor_travels_as_a_cpu_copy():
    header, blob = live_rank.pack(torch.ones(2, device="cuda"))
    assert live_text.unpack(header, blob).device.type == "cpu"


# ---------------------------------------------------------------------------- the kernel side's rules


@pytest.mark.parametrize("text, expected", [
    (None, [0, 1, 2, 3]), ("", [0, 1, 2, 3]), ("all", [0, 1, 2, 3]), ("1", [1]), ("0,2", [0, 2]), ("3 1", [1, 3]),
    ("0-2", [0, 1, 2]), ("1-1", [1]),
])
def test_rank_lists(text, expected):
    assert live_text.parse_ranks(text, 4) == expected


@pytest.mark.parametrize("text, words", [("4", "no rank 4 in a group of 4"), ("2-1", "no rank 2-1"),
                                         ("x", "'x' is not a rank"), ("-1", "'-1' is not a rank")])
def test_bad_rank_lists_are_refused(text, words):
    with pytest.raises(ValueError, match=words):
        live_text.parse_ranks(text, 4)


def test_values_come_back_by_rank():
    assert live_text.per_rank({0: 1, 1: 2}, 2) == [1, 2]
    assert live_text.per_rank({1: 2}, 2) == {1: 2}  # a subset: keyed by rank, never mistaken for rank 0's
    assert live_text.per_rank({0: None, 1: None}, 2) is None
    assert live_text.per_rank({0: None, 1: None}, 2, keep_none=True) == [None, None]


def test_a_failed_cell_names_each_rank_and_shows_a_shared_traceback_once():
    reply = {"status": "error", "where": "In[3]:2 (in <module>)", "error": "ValueError: no",
             "traceback": 'Traceback (most recent call last):\n  File "In[3]", line 2, in <module>\nValueError: no'}
    text = live_text.failure_message({0: reply, 1: reply}, {2: "finished the cell."})
    assert text.splitlines()[:3] == ["rank 0 failed at In[3]:2 (in <module>): ValueError: no",
                                     "rank 1 failed at In[3]:2 (in <module>): ValueError: no",
                                     "rank 2 finished the cell."]
    assert "Every rank keeps its variables" in text
    assert text.count('File "In[3]"') == 1 and "--- rank 1: the same traceback as rank 0 ---" in text


def test_a_broken_group_says_which_rank_is_stuck_and_how_to_recover():
    text = live_text.broken_message({0: "waiting in dist.all_reduce at In[4]:2"})
    assert text.startswith("The process group is broken: rank 0 did not stop.")
    assert "rank 0: waiting in dist.all_reduce at In[4]:2" in text and "%ranks restart" in text


DUMP = """Fatal Python error: Segmentation fault

Current thread 0x00007f0000000002 (most recent call first):
  File "{stdlib}/ctypes/__init__.py", line 519 in string_at
  File "In[4]", line 3 in crash
  File "In[5]", line 1 in <module>
  File "/repo/helpers/launcher/live_rank.py", line 112 in execute
  File "/repo/helpers/launcher/bootstrap.py", line 96 in run_script
"""


def test_a_dead_ranks_stack_is_cut_to_the_cells():
    log = "about to crash\n" + DUMP.format(stdlib=live_text._LIBRARY_DIRS[0])
    sources = {("In[4]", 3): "    return ctypes.string_at(0)\n", ("In[5]", 1): "crash()\n"}
    stack = live_text.cell_stack(log, lambda file, line: sources.get((file, line), ""))
    assert stack.splitlines() == ['  File "In[5]", line 1, in <module>', "    crash()",
                                  '  File "In[4]", line 3, in crash', "    return ctypes.string_at(0)",
                                  '  File "ctypes/__init__.py", line 519, in string_at',
                                  "Fatal Python error: Segmentation fault"]
    assert live_text.cell_stack("no dump here") is None


def test_a_dead_ranks_error_keeps_the_diagnosis_and_says_how_to_recover():
    class Run:
        def __init__(self) -> None:
            self.logs = {1: DUMP.format(stdlib=live_text._LIBRARY_DIRS[0])}

    failure = WorkerFailed("rank 1 failed first, with exit code -11 (SIGSEGV); no other rank is left running.\n"
                           "  where: In[4]:3 (in crash)\n--- last lines of output from rank 1 ---\n(40 lines)\n"
                           "--- logs of every rank: runs/x/ ---", rank=1, exitcode=-11, run=Run())
    text = live_text.death_message(failure)
    assert text.startswith("rank 1 failed first, with exit code -11 (SIGSEGV)") and "where: In[4]:3" in text
    assert "(40 lines)" not in text and 'File "In[4]", line 3, in crash' in text
    assert text.endswith("--- logs of every rank: runs/x/ ---\n" + live_text.RESTART)


def test_where_a_hung_rank_waits_is_its_cells_line():
    torch_dir = "/venv/lib/python3.11/site-packages/torch/distributed"
    dump = ('Current thread 0x1 (most recent call first):\n'
            f'  File "{torch_dir}/distributed_c10d.py", line 3913 in all_reduce\n'
            f'  File "{torch_dir}/c10d_logger.py", line 83 in wrapper\n'
            '  File "In[7]", line 2 in <module>\n'
            f'  File "{live.CELL_LOOP}", line 112 in execute\n')
    assert diagnosis.where(dump, str(live.CELL_LOOP)) == "waiting in dist.all_reduce at In[7]:2"


# ---------------------------------------------------------------------------- the %ranks command line


@pytest.mark.parametrize("line, error, words", [
    ("launch -n 2", ValueError, "unknown command 'launch -n 2'"),
    ("status now", ValueError, "unknown command"),
    ("start -n two", ValueError, "invalid int value"),
    ("start -n 2 --bogus", ValueError, "unknown option"),
])
def test_ranks_refuses_a_bad_line(line, error, words):
    with pytest.raises(error, match=words):
        magic.ranks_line(line)


def test_ranks_cell_refuses_bad_options_and_needs_started_ranks(monkeypatch):
    monkeypatch.setattr(live.LiveRanks, "session", None)
    with pytest.raises(ValueError, match="unknown option"):
        magic.ranks_cell("--bogus 1", "pass")
    with pytest.raises(ValueError, match="invalid float value"):
        magic.ranks_cell("--timeout soon", "pass")
    with pytest.raises(live_text.RanksUnavailable, match="start them with %ranks start -n 2"):
        magic.ranks_cell("", "pass")
    with pytest.raises(live_text.RanksUnavailable, match="start them with"):
        magic.ranks_line("get x")
    with pytest.raises(ValueError, match="nproc must be a whole number"):
        live.LiveRanks(0)
