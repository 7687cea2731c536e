"""The launcher's diagnosis rules, one table row per rule: pure functions, no processes (milliseconds)."""
from __future__ import annotations

import signal

import pytest

from helpers.launcher.diagnosis import (
    NodeRecord,
    clean_traceback,
    crash_site,
    diagnose_failure,
    hang_message,
    meaning_of,
    parse_stacks,
    root_cause,
    where,
)

CLOSED = "RuntimeError: [gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:5044"
RESET = "RuntimeError: Connection reset by peer"
TIMEOUT = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 3000ms for recv operation"
REAL = 'Traceback (most recent call last):\n  File "train.py", line 9, in <module>\nValueError: broke'


def tb(text: str, time: float) -> dict:
    return {"traceback": text, "time": time}


def failed(code: int, timestamp: int = 100) -> dict:
    return {"exitcode": code, "timestamp": timestamp}


SIGKILL, SIGTERM, SIGSEGV = -int(signal.SIGKILL), -int(signal.SIGTERM), -int(signal.SIGSEGV)

ROOT_CAUSE_RULES = [
    # (rule, elastic's failures, bootstrap tracebacks, ranks of the last attempt, expected rank)
    ("1: the earliest genuine exception, even when a peer symptom came first",
     {0: failed(1), 1: failed(1)}, {0: tb(CLOSED, 1.0), 1: tb(REAL, 2.0)}, {0, 1}, 1),
    ("1: of two genuine exceptions, the earlier one",
     {0: failed(1), 1: failed(1)}, {0: tb(REAL, 5.0), 1: tb(REAL, 4.0)}, {0, 1}, 1),
    ("1: a collective timeout is the waiting rank's own error, not a peer symptom",
     {0: failed(1), 1: failed(SIGTERM)}, {0: tb(TIMEOUT, 3.0)}, {0, 1}, 0),
    ("2: a rank killed by a signal we did not send, over the peer it broke",
     {0: failed(1), 1: failed(SIGKILL)}, {0: tb(CLOSED, 1.0)}, {0, 1}, 1),
    ("2: of two signalled ranks, the earlier one",
     {1: failed(SIGKILL, 101), 2: failed(SIGSEGV, 100)}, {0: tb(RESET, 1.0)}, {0, 1, 2}, 2),
    ("2: SIGTERM is ours (stopping the group), never the cause",
     {0: failed(1), 1: failed(SIGTERM)}, {0: tb(CLOSED, 1.0)}, {0, 1, 2}, 2),
    ("3: only peer symptoms: the rank that left without an error",
     {0: failed(1)}, {0: tb(CLOSED, 1.0)}, {0, 1}, 1),
    ("4: only peer symptoms and nobody silent: the earliest of them",
     {0: failed(1), 1: failed(1)}, {0: tb(CLOSED, 2.0), 1: tb(RESET, 1.0)}, {0, 1}, 1),
    ("5: no traceback at all: elastic's order, SIGTERMed ranks last",
     {0: failed(SIGTERM, 100), 1: failed(2, 101)}, {}, {0, 1}, 1),
    ("5: no traceback at all, same time: the lower rank",
     {3: failed(1, 100), 2: failed(1, 100)}, {}, {2, 3}, 2),
]


@pytest.mark.parametrize("rule, failures, tracebacks, ranks, expected", ROOT_CAUSE_RULES,
                         ids=[row[0] for row in ROOT_CAUSE_RULES])
def test_root_cause_rules(rule, failures, tracebacks, ranks, expected):
    assert root_cause(failures, tracebacks, ranks) == expected


def test_failure_across_nodes_names_the_rank_on_the_other_node():
    """Rank 3 (node 1) raises; node 0's ranks only lost their connections: blame rank 3."""
    node0 = NodeRecord(1, {"ok": False, "failures": {"0": failed(1), "1": failed(1)}},
                       {0: tb(CLOSED, 2.0), 1: tb(CLOSED, 2.1)}, {0, 1}, log_dir="runs/node0", node=0)
    node1 = NodeRecord(1, {"ok": False, "failures": {"3": failed(1)}}, {3: tb(REAL, 1.5)}, {2, 3},
                       log_dir="runs/node1", node=1)
    found = diagnose_failure([node0, node1])
    assert (found.rank, found.exitcode, found.node) == (3, 1, 1)
    assert found.message.startswith("rank 3 failed first, with exit code 1")
    assert "ValueError: broke" in found.message and "runs/node1/" in found.message


def test_an_agent_we_stopped_is_not_blamed_over_the_rank_that_failed():
    """Node 1 fails first; the launcher SIGTERMs node 0's agent, which records that as its own error."""
    stopped = NodeRecord(2, {"ok": False, "agent_error": "SignalException: Process 12066 got signal: 15"},
                         {0: tb(CLOSED, 2.0)}, {0, 1}, node=0)
    failed_node = NodeRecord(1, {"ok": False, "failures": {"3": failed(1)}}, {3: tb(REAL, 1.5)}, {2, 3}, node=1)
    found = diagnose_failure([stopped, failed_node])
    assert (found.rank, found.node) == (3, 1) and "ValueError: broke" in found.message


@pytest.mark.parametrize("record, words", [
    (NodeRecord(2, {"ok": False, "agent_error": "Traceback ...\nRendezvousError: no"}, {}, set()),
     "the torchrun agent of node 0 itself failed"),
    (NodeRecord(-9, {}, {}, {0, 1}), "the torchrun agent exited with code -9 and reported no failed rank"),
])
def test_agent_level_failures(record, words):
    found = diagnose_failure([record])
    assert words in found.message and found.rank is None


def test_a_silent_rank_shows_its_last_lines():
    record = NodeRecord(1, {"failures": {"0": failed(1)}}, {0: tb(CLOSED, 1.0)}, {0, 1},
                        logs={1: "step 1\nstep 2\n"})
    found = diagnose_failure([record])
    assert found.rank == 1 and found.exitcode is None
    assert "no Python error" in found.message and "last lines of output" in found.message and "step 2" in found.message


def test_clean_traceback_drops_launcher_frames_and_machine_paths():
    text = ('Traceback (most recent call last):\n'
            '  File "/opt/py/lib/python3.11/runpy.py", line 291, in run_path\n    code\n'
            '  File "/home/me/repo/helpers/launcher/bootstrap.py", line 80, in run_script\n    runpy.run_path(script)\n'
            '  File "/home/me/repo/train.py", line 9, in <module>\n    dist.all_reduce(t)\n'
            '  File "/home/me/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83\n'
            'ValueError: broke\n')
    cleaned = clean_traceback(text, ("/home/me/repo",))
    assert "runpy" not in cleaned and "bootstrap.py" not in cleaned and "run_script" not in cleaned
    assert '"train.py", line 9' in cleaned and '".../site-packages/torch/distributed/c10d_logger.py"' in cleaned
    inside = text.replace("/home/me/.venv/", "/home/me/repo/.venv/")  # a venv inside the repository reads the same
    assert clean_traceback(inside, ("/home/me/repo",)) == cleaned


# ---------------------------------------------------------------------------- hangs

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/py/lib/python3.11"


def dump(*threads: list[tuple[str, int, str]]) -> str:
    """A faulthandler dump: threads listed newest first, the current one marked."""
    parts = []
    for i, frames in enumerate(threads):
        head = "Current thread" if i == len(threads) - 1 else "Thread"
        lines = "".join(f'  File "{file}", line {line} in {func}\n' for file, line, func in frames)
        parts.append(f"{head} 0x00007f{i:010x} (most recent call first):\n{lines}")
    return "\n".join(parts)


SCRIPT = "/repo/train.py"
FORKED_BELOW = [("/repo/helpers/launcher/bootstrap.py", 80, "run_script"), (f"{STDLIB}/runpy.py", 291, "run_path"),
                ("/repo/helpers/launcher/agent.py", 70, "run_agent"),
                ("/repo/helpers/launcher/server.py", 50, "_start_agent")]
SOURCE = {(SCRIPT, 57): "        time.sleep(120)", (SCRIPT, 60): "    total = 0", (SCRIPT, 61): "x = y"}

WHERE_RULES = [
    ("a collective: named as dist.<function>, through c10d_logger's wrapper",
     dump([(f"{SITE}/torch/distributed/distributed_c10d.py", 3913, "all_reduce"),
           (f"{SITE}/torch/distributed/c10d_logger.py", 83, "wrapper"), (SCRIPT, 42, "step"),
           (SCRIPT, 70, "<module>"), *FORKED_BELOW]), 7, "waiting in dist.all_reduce at train.py:42 (step 7)"),
    ("a call into C has no frame: its name comes from the source line",
     dump([(SCRIPT, 57, "<module>"), *FORKED_BELOW]), None, "in time.sleep at train.py:57"),
    ("the main thread is the one running the script, not a helper thread",
     dump([(f"{STDLIB}/threading.py", 324, "wait"), (f"{STDLIB}/threading.py", 1002, "_bootstrap")],
          [(SCRIPT, 57, "<module>")]), None, "in time.sleep at train.py:57"),
    ("a library call that is not a collective: file.function, skipping calls that only forward",
     dump([(f"{SITE}/torch/nn/modules/linear.py", 125, "forward"),
           (f"{SITE}/torch/nn/modules/module.py", 1775, "_call_impl"),
           (f"{SITE}/torch/nn/modules/module.py", 1764, "_wrapped_call_impl"), (SCRIPT, 30, "<module>")]),
     None, "in linear.forward at train.py:30"),
    ("a collective deep inside a library (DDP's forward): still the collective",
     dump([(f"{SITE}/torch/distributed/distributed_c10d.py", 4500, "broadcast"),
           (f"{SITE}/torch/distributed/utils.py", 280, "_sync_module_states"),
           (f"{SITE}/torch/nn/parallel/distributed.py", 900, "__init__"), (SCRIPT, 20, "<module>")]),
     None, "waiting in dist.broadcast at train.py:20"),
    ("a torch.distributed package (rpc) is named by its package, not its file (api.py)",
     dump([(f"{SITE}/torch/distributed/rpc/api.py", 101, "shutdown"),
           (f"{SITE}/torch/distributed/rpc/api.py", 80, "wrapper"), (SCRIPT, 90, "<module>")]),
     149, "in rpc.shutdown at train.py:90 (step 149)"),
    ("a kit function between the learner and the collective: the learner's own call is blamed",
     dump([(f"{SITE}/torch/distributed/distributed_c10d.py", 1700, "init_process_group"),
           (f"{SITE}/torch/distributed/c10d_logger.py", 95, "wrapper"),
           ("/repo/helpers/kit/distributed.py", 40, "init_distributed"), (SCRIPT, 12, "<module>"), *FORKED_BELOW]),
     None, "waiting in dist.init_process_group at train.py:12"),
    ("a learner's class run by a course worker (lesson 09): the class's line, not the worker's",
     dump([(f"{SITE}/torch/distributed/distributed_c10d.py", 3913, "all_reduce"),
           ("/repo/notebooks/my_zero.py", 31, "step"), (SCRIPT, 80, "main"), (SCRIPT, 99, "<module>")]),
     None, "waiting in dist.all_reduce at my_zero.py:31"),
    ("plain Python on the learner's line, no call: running",
     dump([(SCRIPT, 61, "<module>")]), 3, "running at train.py:61 (step 3)"),
    ("nothing in the dump (the process did not answer)", "", None, "no Python stack (the process did not answer)"),
    ("no frame of the script: it returned (or has not started), so the launcher's frame is not blamed",
     dump([("/repo/helpers/launcher/agent.py", 78, "launch_agent"), *FORKED_BELOW[1:]]), None,
     "not in train.py: it has returned, or not started yet (the process is in launch_agent at agent.py:78)"),
]


@pytest.mark.parametrize("rule, text, step, expected", WHERE_RULES, ids=[row[0] for row in WHERE_RULES])
def test_where_rules(rule, text, step, expected):
    read_line = lambda file, line: SOURCE.get((file, line), "")  # noqa: E731
    assert where(text, SCRIPT, (STDLIB,), step, read_line) == expected


def test_parse_stacks_splits_threads_innermost_first():
    threads = parse_stacks(dump([(STDLIB + "/threading.py", 1, "run")], [(SCRIPT, 2, "f"), (SCRIPT, 3, "<module>")]))
    assert threads == [[(STDLIB + "/threading.py", 1, "run")], [(SCRIPT, 2, "f"), (SCRIPT, 3, "<module>")]]


def test_hang_message_lists_every_rank():
    places = {0: "waiting in dist.all_reduce at t.py:4", 1: "in time.sleep at t.py:6"}
    text = hang_message("timed out after 3 s", places, {0: "a\nb\n", 1: ""}, "runs/x")
    assert "  rank 0: waiting in dist.all_reduce at t.py:4\n  rank 1: in time.sleep at t.py:6" in text
    assert "[rank 0] b" in text and "[rank 1] (no output)" in text and "runs/x/stacks/" in text


def test_the_last_line_of_a_rank_is_not_a_warning():
    # lesson 09's check runs fully_shard, whose UserWarning (file:line: UserWarning: ..., then the source line) was
    # the last thing each rank printed before a hang in the learner's class
    log = ("step 0\n/venv/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py:262: "
           "UserWarning: something about hooks\n  output = self._register_pre_backward_hook(output)\n"
           "/repo/helpers/workers/zero_check.py:333: UserWarning: Converting a tensor with requires_grad=True to a "
           "scalar may lead to unexpected behavior.\nConsider using tensor.detach() first.\n  out = max(values)\n"
           "/venv/lib/python3.11/site-packages/torch/x.py:9: FutureWarning: soon\n")
    only = "".join(log.splitlines(keepends=True)[1:3])  # nothing but the UserWarning: its own line, not the source
    text = hang_message("timed out after 3 s", {}, {0: log, 1: only}, "runs/x")
    assert "[rank 0] step 0\n" in text, text
    assert "[rank 1] /venv/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py:262: " \
           "UserWarning: something about hooks\n" in text, text


# ---------------------------------------------------------------------------- where a crash happened, and what it means

ABORT_LOG = """step 1
terminate called after throwing an instance of 'gloo::EnforceNotMet'
  what():  [enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:464] \
op.preamble.length <= op.nbytes. 12 vs 8. Received data size doesn't match expected size.
Fatal Python error: Aborted

Thread 0x00007f0000000001 (most recent call first):
  File "/py/lib/python3.11/threading.py", line 324 in wait
Current thread 0x00007f0000000002 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3913 in all_reduce
  File "/repo/helpers/kit/distributed.py", line 60 in all_reduce_mean
  File "/repo/notebooks/my_zero.py", line 31 in step
  File "/repo/helpers/workers/zero_check.py", line 80 in main
  File "/repo/helpers/launcher/bootstrap.py", line 99 in run_script
"""


def test_a_crash_is_placed_at_the_learners_line_from_the_traceback():
    text = ('Traceback (most recent call last):\n'
            '  File "/repo/helpers/launcher/bootstrap.py", line 99, in run_script\n    runpy.run_path(script)\n'
            '  File "/repo/helpers/workers/zero_check.py", line 80, in main\n    impl.step()\n'
            '  File "/repo/notebooks/my_zero.py", line 31, in step\n    shard = flat[r]\n'
            '  File "/repo/helpers/kit/zero.py", line 12, in padded_flat\n    raise ValueError("no")\n'
            'ValueError: no\n')
    assert crash_site(text, "", ("/py/lib",)) == ("my_zero.py:31 (in step)", "ValueError: no")


def test_a_crash_in_a_helper_of_another_learner_file_names_the_call_too():
    """A Zero2 calling its Zero1 parent's method: the failing line is my_zero1.py's, the call that led there
    my_zero2.py's. The course's worker that ran the class is not named as a caller."""
    text = ('Traceback (most recent call last):\n'
            '  File "/repo/helpers/workers/zero_check.py", line 80, in main\n    impl.step()\n'
            '  File "/repo/notebooks/my_zero2.py", line 31, in step\n    super().step()\n'
            '  File "/repo/notebooks/my_zero1.py", line 25, in step\n    self._reduce_scatter(p)\n'
            '  File "/repo/notebooks/my_zero1.py", line 20, in _reduce_scatter\n    p.grad.detach()\n'
            "AttributeError: 'NoneType' object has no attribute 'detach'\n")
    where, _ = crash_site(text, "")
    assert where == "my_zero1.py:20 (in _reduce_scatter), called from my_zero2.py:31 (in step)"
    alone = text.replace("my_zero2.py", "my_zero1.py")  # one learner file: no caller added
    assert crash_site(alone, "")[0] == "my_zero1.py:20 (in _reduce_scatter)"


def test_a_rank_killed_by_an_abort_is_placed_from_faulthandlers_stacks():
    where, error = crash_site(None, ABORT_LOG, ("/py/lib",))
    assert where == "my_zero.py:31 (in step)"
    assert error.startswith("enforce fail at") and "12 vs 8" in error
    assert crash_site(None, "just output\n") == (None, None)


@pytest.mark.parametrize("text, words", [
    (ABORT_LOG, "a peer sent this rank 12 bytes where it expected at most 8"),
    ("RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 0 (expected (8), got (9))",
     "has the wrong size (expected 8, got 9)"),
    ("RuntimeError: [rank0]:[F1206 ProcessGroupGloo.cpp:1583] Check failed: outputShape[0] * worldSize == "
     "inputShape[0] (36 vs. 35)", "exactly world-size times the other (36 vs. 35)"),
    ("RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running collective: ...",
     "called different collectives"),
    ("RuntimeError: [../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:38323",
     "another rank left"),
    ("ValueError: my own bug", None),
])
def test_what_a_collectives_error_means(text, words):
    meaning = meaning_of(text)
    assert (meaning is None) if words is None else (words in meaning), meaning


def test_the_failure_message_leads_with_where_and_what_it_means():
    node = NodeRecord(agent_code=1, outcome={"failures": {"1": {"exitcode": -6, "signal": "SIGABRT", "timestamp": 1}}},
                      tracebacks={}, ranks={0, 1}, logs={1: ABORT_LOG}, log_dir="runs/x")
    found = diagnose_failure([node], library_dirs=("/py/lib",))
    assert found.rank == 1 and found.where == "my_zero.py:31 (in step)" and "12 vs 8" in found.error
    head = found.message.splitlines()[:3]
    assert head[1] == "  where: my_zero.py:31 (in step)" and head[2].startswith("  what it means: a peer sent")
