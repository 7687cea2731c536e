"""What went wrong in a launch, from the records of its run folders: pure functions, no processes.

Two questions, both answered from plain data so that every rule has a unit test (tests/fast/test_diagnosis.py):
- a job failed: which rank failed *first* (the root cause, not the peers it broke), and what to show;
- a job hangs: where is each rank stuck, from the Python stacks faulthandler dumped.
"""
from __future__ import annotations

import linecache
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

from helpers.kit.run_files import node_file, stacks_folder

# What a rank says when a *peer* died: a symptom, never the root cause. A timeout is not in the list:
# a rank that hangs never errors, so the rank whose collective timed out is the one to report.
PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Connection refused")
_SIGTERM = -int(signal.SIGTERM)


@dataclass
class NodeRecord:
    """What one node's run folder says after the job stopped."""

    agent_code: int | None
    outcome: dict  # the agent's result file: {"ok": ...} / {"failures": {rank: {...}}} / {"agent_error": ...}
    tracebacks: dict[int, dict]  # rank -> {"time": ..., "traceback": ...} (the bootstrap's failure records)
    ranks: set[int]  # the ranks of the last attempt
    logs: dict[int, str] = field(default_factory=dict)
    log_dir: str = "."
    node: int = 0


@dataclass
class Diagnosis:
    message: str
    rank: int | None = None
    exitcode: int | None = None
    node: int = 0
    where: str | None = None  # the learner's own line that failed: "my_zero.py:31 (in step)"
    error: str | None = None  # the exception's last line, or the C++ check that stopped the process
    meaning: str | None = None  # what a C++ check from a collective means, in a sentence


# C++ checks that stop a rank inside a collective, as gloo and c10d word them, and what each means for the learner.
MEANINGS: list[tuple[re.Pattern, str]] = [
    (re.compile(r"op\.preamble\.length <= op\.nbytes\. (\d+) vs (\d+)"),
     "a peer sent this rank {0} bytes where it expected at most {1}: the ranks disagree on the size of a message in "
     "this collective (tensors of different shapes, or all-to-all split sizes that do not match on both sides)"),
    (re.compile(r"Check failed: \w+Shape\[0\] \* worldSize == \w+Shape\[0\] \((\d+) vs\. (\d+)\)"),
     "a one-tensor reduce-scatter or all-gather needs one tensor exactly world-size times the other ({0} vs. {1}): "
     "the flat tensor's length is not a multiple of the world size (pad it with zeros first)"),
    (re.compile(r"invalid tensor size at index \d+ \(expected \(([\d, ]+)\), got \(([\d, ]+)\)\)"),
     "a tensor of this collective has the wrong size (expected {0}, got {1}): every rank must pass the same shape, "
     "and a one-tensor all-gather's output must hold exactly world-size times its input (pad to a multiple of the "
     "world size)"),
    (re.compile(r"Detected mismatch between collectives on ranks"),
     "the ranks called different collectives (or the same one with other shapes or dtypes) at the same point"),
    (re.compile(r"Timed out waiting \d+ms for recv operation to complete|Wait timeout|timed out", re.I),
     "a collective waited past the process group's timeout: another rank never joined it"),
    (re.compile(r"Connection (closed|reset) by peer"),
     "another rank left (it exited or crashed) while this one waited for it in a collective"),
]
# The line that says why C++ stopped a process, most telling first.
_CPP_CHECKS = [re.compile(r"enforce fail at [^\n]*"), re.compile(r"ProcessGroup\w+::\w+: [^\n]*"),
               re.compile(r"terminate called[^\n]*")]
_TRACEBACK_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)', re.M)


def meaning_of(text: str) -> str | None:
    """What the first C++ check or collective error found in `text` means, or None."""
    for pattern, sentence in MEANINGS:
        found = pattern.search(text)
        if found:
            return sentence.format(*found.groups())
    return None


def learner_frame(frames: list[Frame], library_dirs: tuple[str, ...] = ()) -> str | None:
    """The innermost frame that is the learner's (not Python's, torch's, or the course's launcher or kit), as
    'file.py:line (in function)'; frames are innermost first. When the learner's code in another file called it (a
    Zero2 calling its Zero1 parent's helper), that call is added: '..., called from other.py:31 (in step)'. The
    course's own workers (helpers/workers/, which run the learner's classes) are not named as callers."""
    mine = [(file, line, func) for file, line, func in frames if not _is_library(file, library_dirs)]
    if not mine:
        return None
    file, line, func = mine[0]
    place = f"{os.path.basename(file)}:{line} (in {func})"
    caller = next((frame for frame in mine[1:] if frame[0] != file), None)
    if caller and "/helpers/" not in caller[0].replace("\\", "/"):
        place += f", called from {os.path.basename(caller[0])}:{caller[1]} (in {caller[2]})"
    return place


def crash_site(traceback_text: str | None, log_text: str, library_dirs: tuple[str, ...] = ()) -> tuple[
        str | None, str | None]:
    """(the learner's line, the error's line) of a failed rank: from its Python traceback, or, when a signal killed
    it (a C++ abort or a segfault), from the stacks faulthandler wrote into its log."""
    if traceback_text:
        frames = [(m["file"], int(m["line"]), m["func"]) for m in _TRACEBACK_FRAME.finditer(traceback_text)]
        lines = [line for line in traceback_text.rstrip().splitlines() if line and not line.startswith(" ")]
        return learner_frame(frames[::-1], library_dirs), (lines[-1] if lines else None)
    fatal = log_text.rfind("Fatal Python error:")
    check = next((found[0] for found in (pattern.search(log_text) for pattern in _CPP_CHECKS) if found), None)
    error = check or (log_text[fatal:].splitlines()[0] if fatal >= 0 else None)
    if fatal < 0:
        return None, error
    for thread in parse_stacks(log_text[fatal:]):
        place = learner_frame(thread, library_dirs)
        if place:
            return place, error
    return None, error


def root_cause(failures: dict[int, dict], tracebacks: dict[int, dict], ranks: set[int]) -> int:
    """The rank that failed first, from the best evidence available, in this order:

    1. the earliest exception that is not a peer-connection symptom (the bootstrap records exact times;
       elastic's own summary lists only the ranks it saw at one poll, with whole-second timestamps);
    2. a rank killed by a signal we did not send (SIGKILL by the OOM killer, SIGSEGV, ...): it leaves
       no traceback, and the ranks it broke only report lost connections;
    3. when every traceback is such a symptom, a rank that left without one (killed, or exited early);
    4. the earliest exception of any kind; 5. elastic's order, SIGTERMed ranks last.
    """
    genuine = [r for r in tracebacks if not any(s in tracebacks[r]["traceback"] for s in PEER_SYMPTOMS)]
    if genuine:
        return min(genuine, key=lambda r: tracebacks[r]["time"])
    signalled = [r for r in failures if r not in tracebacks and failures[r]["exitcode"] < 0
                 and failures[r]["exitcode"] != _SIGTERM]
    if signalled:
        return min(signalled, key=lambda r: (failures[r]["timestamp"], r))
    silent = sorted(ranks - set(tracebacks) - {r for r in failures if failures[r]["exitcode"] == _SIGTERM})
    if tracebacks and silent:
        return silent[0]
    if tracebacks:
        return min(tracebacks, key=lambda r: tracebacks[r]["time"])
    return min(failures, key=lambda r: (failures[r]["exitcode"] == _SIGTERM, failures[r]["timestamp"], r))


_SKIP_FRAME = re.compile(r'  File "[^"]*(runpy\.py|<frozen runpy>|helpers/launcher/bootstrap\.py)".*\n(    .*\n)*')


def clean_traceback(text: str, bases: tuple[str, ...] = ()) -> str:
    """Drop the launcher's own frames and shorten paths so the learner sees their code."""
    text = _SKIP_FRAME.sub("", text)
    # site-packages first: a virtual environment inside the repository (.venv/) reads the same as one outside it
    text = re.sub(r'"/[^"]*/site-packages/', '".../site-packages/', text)
    for base in bases:
        text = text.replace(base.rstrip(os.sep) + os.sep, "")
    return text


def last_lines(text: str, count: int = 15) -> str:
    lines = text.rstrip().splitlines()
    return "\n".join(lines[-count:]) if lines else "(no output)"


def diagnose_failure(nodes: list[NodeRecord], bases: tuple[str, ...] = (),
                     library_dirs: tuple[str, ...] = ()) -> Diagnosis:
    """The first failure across every node of a job (ranks are global, so their records merge).

    A rank's own error beats an agent's: once one node fails, the launcher stops the others, and an
    agent stopped that way reports the SIGTERM it got (SignalException) as its own error.
    """
    failures = {int(r): info for node in nodes for r, info in node.outcome.get("failures", {}).items()}
    tracebacks = {r: record for node in nodes for r, record in node.tracebacks.items()}
    for node in nodes:
        if "agent_error" in node.outcome and not failures and not tracebacks:
            return Diagnosis(f"the torchrun agent of node {node.node} itself failed:\n"
                             f"{clean_traceback(node.outcome['agent_error'], bases)}\nLogs: {node.log_dir}/",
                             node=node.node)
    if not failures and not tracebacks:
        node = next((n for n in nodes if n.agent_code not in (None, 0)), nodes[0])
        return Diagnosis(f"the torchrun agent exited with code {node.agent_code} and reported no failed "
                         f"rank; see {node_file(node.log_dir, 'agent_log', node.node)}", node=node.node)
    rank = root_cause(failures, tracebacks, set().union(*(node.ranks for node in nodes)))
    home = next((n for n in nodes if rank in n.ranks or rank in n.tracebacks
                 or str(rank) in n.outcome.get("failures", {})), nodes[0])
    if rank in failures:
        info = failures[rank]
        code = info["exitcode"]
        how = f"exit code {code}" + (f" ({info['signal']})" if info.get("signal") else "")
    elif rank in tracebacks:
        code, how = 1, "exit code 1"  # an uncaught Python exception exits with 1
    else:
        code, how = None, "no Python error (killed by a signal, or it left while its peers still waited)"
    record = tracebacks.get(rank)
    log = home.logs.get(rank, "")
    body = clean_traceback(record["traceback"], bases) if record else last_lines(log)
    title = "traceback" if record else "last lines of output"
    where, error = crash_site(record["traceback"] if record else None, log, library_dirs)
    meaning = meaning_of(record["traceback"] if record else log)
    said = "".join([f"\n  where: {where}" if where else "", f"\n  what it means: {meaning}" if meaning else ""])
    return Diagnosis(f"rank {rank} failed first, with {how}; no other rank is left running.{said}\n"
                     f"--- {title} from rank {rank} ---\n{body.rstrip()}\n"
                     f"--- logs of every rank: {home.log_dir}/ ---", rank=rank, exitcode=code, node=home.node,
                     where=where, error=error, meaning=meaning)


# ---------------------------------------------------------------------------- hangs

_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", re.M)
_FRAME = re.compile(r'^  File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)', re.M)
# Frames that only forward a call: the collective is the frame they lead to.
_FORWARDERS = {"wrapper", "inner", "_fn", "__call__", "_call_impl", "_wrapped_call_impl", "decorate_context"}
_CALLEE = re.compile(r"([A-Za-z_][\w.]*)\s*\(")

Frame = tuple[str, int, str]  # file, line, function


def parse_stacks(dump: str) -> list[list[Frame]]:
    """faulthandler's dump -> one list of frames per thread, innermost first."""
    starts = [m.start() for m in _THREAD.finditer(dump)] or [0]
    return [[(m["file"], int(m["line"]), m["func"]) for m in _FRAME.finditer(dump[a:b])]
            for a, b in zip(starts, [*starts[1:], len(dump)], strict=True)]


def _is_library(path: str, library_dirs: tuple[str, ...]) -> bool:
    """Frames that are not the learner's: Python's and torch's, and the course's own launcher and worker kit (a rank
    stuck in init_process_group under kit/distributed.py's init_distributed is blamed on the learner's call)."""
    name = path.replace("\\", "/")
    return (name.startswith("<") or any(name.startswith(d) for d in library_dirs)
            or "/site-packages/" in name or re.search(r"/helpers/(launcher|kit)/[^/]+\.py$", name) is not None)


def _qualified(file: str, func: str) -> str:
    """rpc.shutdown for torch/distributed/rpc/api.py, linear.forward for torch/nn/modules/linear.py."""
    package = re.search(r"torch/distributed/(\w+)/", file.replace("\\", "/"))
    return f"{package[1] if package else os.path.splitext(os.path.basename(file))[0]}.{func}"


def where(dump: str, script: str, library_dirs: tuple[str, ...] = (), step: int | None = None,
          read_line: Callable[[str, int], str] = linecache.getline) -> str:
    """One line saying where a rank is: the call it is stuck in, at the learner's innermost line.

    `dump` is one faulthandler dump of the rank; the thread that runs `script` is the main one. A call
    into C (time.sleep) has no Python frame of its own: its name comes from the learner's source line,
    read with `read_line(file, line)`. `step` is the last step the rank reported, if any.
    """
    threads = [t for t in parse_stacks(dump) if t]
    if not threads:
        return "no Python stack (the process did not answer)"
    main = next((t for t in threads if any(f == script for f, _, _ in t)), None)
    if main is None:  # e.g. its main() returned and the rank waits for the others to exit
        file, line, func = threads[-1][0]
        return (f"not in {os.path.basename(script)}: it has returned, or not started yet (the process is in "
                f"{func} at {os.path.basename(file)}:{line})")
    mine = next((i for i, (f, _, _) in enumerate(main) if not _is_library(f, library_dirs)), None)
    if mine is None:
        file, line, func = main[0]
        return f"in {func} at {os.path.basename(file)}:{line}"
    file, line, _ = main[mine]
    called = [frame for frame in main[:mine] if frame[2] not in _FORWARDERS]
    if called:
        outer_file, _, func = called[-1]
        waiting = [fn for f, _, fn in called if f.endswith("distributed_c10d.py")]
        what = f"waiting in dist.{waiting[-1]}" if waiting else f"in {_qualified(outer_file, func)}"
    else:
        callee = _CALLEE.search(read_line(file, line) or "")
        what = f"in {callee[1]}" if callee else "running"
    suffix = f" (step {step})" if step is not None else ""
    return f"{what} at {os.path.basename(file)}:{line}{suffix}"


_WARNING = re.compile(r"^\S.*:\d+: \w*Warning: ")  # warnings.showwarning's first line: file:line: Category: text


def last_printed_line(text: str) -> str:
    """The last line a rank printed, passing over Python warnings (each "file:line: SomeWarning: ..." line, the lines
    of a message that runs on, and the indented source line warnings prints under it), which tell nothing of where
    the rank's own code was."""
    lines = text.splitlines()
    if not text.strip():
        return "(no output)"
    end = len(lines)
    while end > 0:
        if _WARNING.match(lines[end - 1]):
            end -= 1
            continue
        # the source line (indented) and up to 3 lines of message above it, back to a warning's first line
        body = 1 if lines[end - 1].startswith("  ") else 0
        start = next((i for i in range(end - 1 - body, max(end - 5 - body, 0) - 1, -1) if _WARNING.match(lines[i])),
                     None)
        if body and start is not None and not any(line.startswith("  ") for line in lines[start + 1:end - 1]):
            end = start
        else:
            return lines[end - 1]
    return next(line for line in reversed(lines) if _WARNING.match(line))  # nothing but warnings: the last one


def hang_message(headline: str, where_by_rank: dict[int, str], logs: dict[int, str], log_dir: str) -> str:
    """The error of a hang: where each rank was (live ranks), then the last line each rank printed (not a warning)."""
    places = "\n".join(f"  rank {rank}: {text}" for rank, text in sorted(where_by_rank.items()))
    tails = "\n".join(f"  [rank {rank}] {last_printed_line(text)}" for rank, text in sorted(logs.items()))
    return (f"{headline}.\nWhere each rank was:\n{places or '  (no rank was running)'}\n"
            f"Last line of each rank:\n{tails or '  (no output)'}\n"
            f"Full stacks: {stacks_folder(log_dir)}/  Logs: {log_dir}/")
