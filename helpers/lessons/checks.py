"""What every exercise check in the lessons shares: telling a learner where they stand.

Every exercise check returns a bool and prints one line that starts with "Correct: " or "Not yet: ",
saying exactly what is still wrong. A check must say "Not yet" on the untouched starting code.
"""
from __future__ import annotations


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
