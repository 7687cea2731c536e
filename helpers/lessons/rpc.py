"""Lesson 05's exercise check (RPC): a counter that lives on one worker, called by another.

    check_counter("my_counter.py")          # prints "Correct: ..." or "Not yet: ..."
"""
from __future__ import annotations

from helpers.lessons.checks import correct, not_yet

SERIAL_SECONDS = 0.6  # ten add() calls one after another take at least 10 x 0.1 s; at once, about 0.1 + 10 x 0.01 s


def check_counter(script: str) -> bool:
    """The exercise's check: launch `script` on 2 processes and say what is right, or what is still wrong.

    The owner is the name the script reports (`counter.owner().name`): the check cannot see inside worker1. The
    timing and the count make a local stand-in (a thread pool on worker0) unlikely to pass by accident, not
    impossible to write on purpose."""
    from helpers import launch

    got = launch(script, nproc=2, echo=False, timeout=60).results.get(0, {})
    count, owner, partial, seconds = (got.get(key) for key in ("count", "owner", "partial_counts", "seconds"))
    problems = []
    if owner != "worker1":
        problems.append(f"the counter lives on {owner!r}: create it on worker1 with rpc.remote and call it "
                        "through the RRef")
    if seconds is None or seconds > SERIAL_SECONDS:
        problems.append(f"the ten add() calls took more than {SERIAL_SECONDS} s, so they ran one after another: "
                        "send all ten with counter.rpc_async().add(1), then wait for the futures")
    if count != 10 or partial != list(range(1, 11)):
        problems.append(f"the count is {count!r} and the ten add() calls returned {partial!r}, not 1..10: calls "
                        "running at once overwrote each other's update; guard add()'s read and write with a "
                        "threading.Lock")
    if problems:
        return not_yet("; ".join(problems) + ".")
    return correct(f"your script reports worker1 as the counter's owner; ten add() calls ran there at once (in less "
                   f"than {SERIAL_SECONDS} s), and the lock kept every update: they returned 1..10 and the total is "
                   "10.")
