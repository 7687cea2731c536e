"""What every exercise check in the lessons shares: telling a learner where they stand.

Every exercise check returns a bool and prints one line that starts with "Correct: " or "Not yet: ",
saying exactly what is still wrong. A check must say "Not yet" on the untouched starting code.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable


def correct(message: str) -> bool:
    """Print "Correct: message" and return True."""
    print(f"Correct: {message}")
    return True


def not_yet(message: str) -> bool:
    """Print "Not yet: message" and return False."""
    print(f"Not yet: {message}")
    return False


def announce_run(script_name: str, nproc: int, timeout: float, stop_after: float) -> None:
    """Say at once what an exercise check runs, how long it usually takes, and when to press Stop."""
    print(f"Running {script_name} on {nproc} ranks (usually a few seconds; the check gives up after {timeout:g} s). "
          f"If nothing comes back within {stop_after:g} s, press Stop (■): the launcher then says where each rank "
          "is waiting.", flush=True)


def each_rank(where: dict[int, str]) -> str:
    """A timeout's 'where each rank was', one rank per line, as the launcher's own Stop message lists them."""
    return "".join(f"\n  rank {rank}: {line}" for rank, line in sorted(where.items())) or " unknown"


def explain_crash(error: BaseException, what: str = "the check") -> str:
    """A failed launch in one paragraph a learner can act on: which rank failed, the error, the learner's own
    file:line, what a C++ check from a collective means, and the run folder to open. For a hang (LaunchTimeout):
    where each rank was waiting."""
    run = getattr(error, "run", None)
    folder = (f" Each rank's output and traceback are in {run.log_dir}/rank<N>.log." if run is not None else "")
    where_by_rank = getattr(error, "where", None)
    if isinstance(where_by_rank, dict):  # a timeout or an interrupt: no rank failed, each one waited somewhere
        return f"{what} did not finish; where each rank was:{each_rank(where_by_rank)}.{folder}"
    rank, code = getattr(error, "rank", None), getattr(error, "exitcode", None)
    text = (getattr(error, "error", None) or str(error).splitlines()[0]).rstrip(".: ")
    if rank is None:  # no rank failed: the agent itself, or a launch that could not start
        return f"{what} failed: {text}.{folder}"
    how = f" (exit code {code}: killed by a signal, so no Python traceback)" if code is not None and code < 0 else ""
    place = f" at {error.where}" if getattr(error, "where", None) else ""
    meaning = f" What it means: {error.meaning}." if getattr(error, "meaning", None) else ""
    return f"{what} crashed on rank {rank}{place}{how}: {text}.{meaning}{folder}"


def not_yet_crashed(error: BaseException, what: str = "the check") -> bool:
    """`not_yet` with explain_crash's paragraph: the one message every exercise check prints when a launch fails."""
    return not_yet(explain_crash(error, what))


def your_line(function: Callable, error: BaseException) -> str:
    """' (line N of your function: text)': the last line of the learner's `function` that `error` passed through,
    counted from its `def`, or '' when none did. For a check that calls the learner's function in the kernel."""
    code = getattr(function, "__code__", None)
    frames = [frame for frame in traceback.extract_tb(error.__traceback__)
              if code is not None and frame.filename == code.co_filename and frame.lineno >= code.co_firstlineno]
    if not frames:
        return ""
    text = f": {frames[-1].line}" if frames[-1].line else ""
    return f" (line {frames[-1].lineno - code.co_firstlineno + 1} of your {function.__name__}{text})"
