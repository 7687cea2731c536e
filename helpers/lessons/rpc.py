"""Lesson 05's exercise check (RPC): a counter that lives on one worker, called by another; and what the lesson reads
from torch's source.

    check_counter("my_counter.py")          # prints "Correct: ..." or "Not yet: ..."
    step_locks()                            # which remote optimizer step takes a lock (read from torch's source)
"""
from __future__ import annotations

import ast
import inspect
import textwrap
import threading
from pathlib import Path

from helpers.lessons.checks import announce_run, correct, each_rank, not_yet, not_yet_crashed

SERIAL_SECONDS = 0.6  # ten add() calls one after another take at least 10 x 0.1 s; at once, about 0.1 + 10 x 0.01 s
# add()'s own sleeps make a floor no machine beats: 0.1 s of slow work, then ten 0.01 s updates one at a time under
# the lock. Faster means a sleep was removed, and then neither the overlap nor the lock was tested.
FLOOR_SECONDS = 0.1 + 10 * 0.01


def check_counter(script: str | Path, timeout: float = 60) -> bool:
    """The exercise's check: launch `script` on 2 processes and say what is right, or what is still wrong.

    The owner is where the Counter object was created, as the script reports it (`Counter.where()`, which returns
    the name recorded by its constructor). The timing and the count make a local stand-in (a thread pool on worker0)
    unlikely to pass by accident, not impossible to write on purpose. The timing is bounded on both sides: above
    by SERIAL_SECONDS (calls one after another), below by FLOOR_SECONDS (add()'s sleeps removed)."""
    from helpers import LaunchTimeout, WorkerFailed, launch

    name = Path(script).name
    if not Path(script).exists():
        return not_yet(f"{name} does not exist yet: run the %%writefile cell above it first.")
    source = Path(script).read_text()
    announce_run(name, 2, timeout, stop_after=20)
    try:
        got = launch(script, nproc=2, echo=False, timeout=timeout).results.get(0, {})
    except LaunchTimeout as error:
        return not_yet(f"{name} was still running after {timeout:g} s. Is a future never waited for, or a call "
                       f"waiting for itself? Where each rank was:{each_rank(error.where)}")
    except WorkerFailed as error:
        return not_yet_crashed(error, name)
    count, owner, partial, seconds = (got.get(key) for key in ("count", "owner", "partial_counts", "seconds"))
    problems = []
    right_count = count == 10 and partial == list(range(1, 11))
    if _sleeps_missing(source) or (right_count and seconds is not None and seconds < FLOOR_SECONDS):
        problems.append("add() no longer has both of its sleeps (the ten calls took "
                        f"{'?' if seconds is None else f'{seconds:.3f}'} s; with them, at least {FLOOR_SECONDS:g} s: "
                        "0.1 s of slow work, then ten 0.01 s updates one at a time under the lock): keep both "
                        "time.sleep lines in add(); without them calls never overlap, so neither running them at "
                        "once nor the lock is tested")
    if owner != "worker1":
        problems.append(f"the counter was created on {owner!r}: create it on worker1 with rpc.remote(\"worker1\", "
                        "Counter) and call its methods through the RRef (counter.rpc_sync().where() reports where "
                        "it lives)")
    if owner == "worker1" and not _counter_made_by_remote(source):  # e.g. a module-level Counter made by rpc_sync
        problems.append("the counter lives on worker1, but no RRef holds it: create it with rpc.remote(\"worker1\", "
                        "Counter), which returns an RRef, and call its methods through the RRef "
                        "(counter.rpc_async().add(1))")
    if "to_here()" in source:  # a copy's where() still says worker1: its constructor ran there
        problems.append("counter.to_here() copies the Counter to worker0: calls on the copy run there, not on "
                        "worker1 (the copy's where() still reports worker1, the name its constructor recorded); call "
                        "through the RRef instead, counter.rpc_async().add(1)")
    if seconds is None or seconds > SERIAL_SECONDS:
        serial = f"the ten add() calls took more than {SERIAL_SECONDS} s, so they ran one after another"
        if "rpc_async" not in source:
            problems.append(f"{serial}: send all ten with counter.rpc_async().add(1), then wait for the futures")
        elif _waits_where_it_sends(source) and not _lock_around_slow_work(source):
            problems.append(f"{serial}: each future is waited for in the same loop that sends it, so each call "
                            "runs alone; send all ten first (futures = [counter.rpc_async().add(1) for _ in "
                            "range(10)]), then wait for the futures")
        elif "Lock" in source:
            problems.append(f"{serial} on worker1: is your lock held during add()'s slow 0.1 s sleep? Hold it only "
                            "around the read and the write (and send all ten calls before waiting for any)")
        else:
            problems.append(f"{serial}: send all ten with counter.rpc_async().add(1) before you wait for any of "
                            "the futures")
    if not right_count:
        problems.append(f"the count is {count!r} and the ten add() calls returned {partial!r}, not 1..10: calls "
                        "running at once overwrote each other's update; guard add()'s read and write with a "
                        "threading.Lock")
    if problems:
        return not_yet("; ".join(problems) + ".")
    return correct(f"the counter lives on worker1; ten add() calls ran there at once (in less than {SERIAL_SECONDS} "
                   "s), and the lock kept every update: they returned 1..10 and the total is 10.")


def _sleeps_missing(source: str) -> bool:
    """Whether Counter.add in the learner's source lacks time.sleep(0.1) or time.sleep(0.01) (read with ast, so
    comments and spacing do not matter). A source that does not parse is left to the launch to report."""
    tree = _parsed(source)
    if tree is None:
        return False
    calls = {ast.unparse(node) for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "Counter"
             for method in cls.body if isinstance(method, ast.FunctionDef) and method.name == "add"
             for node in ast.walk(method) if isinstance(node, ast.Call)}
    return not {"time.sleep(0.1)", "time.sleep(0.01)"} <= calls


def _counter_made_by_remote(source: str) -> bool:
    """Whether the source calls remote(...) (rpc.remote or a bare `remote`) with a function, by position or as func=:
    the call that returns an RRef to what that function builds on the owner (Counter itself, or a function that
    returns one). A source that does not parse is left to the launch to report."""
    tree = _parsed(source)
    if tree is None:
        return True
    for call in (node for node in ast.walk(tree) if isinstance(node, ast.Call)):
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", None)
        functions = call.args[1:2] + [keyword.value for keyword in call.keywords if keyword.arg == "func"]
        if name == "remote" and functions:
            return True
    return False


def _parsed(source: str) -> ast.Module | None:
    try:
        return ast.parse(source)
    except SyntaxError:
        return None


def _waits_where_it_sends(source: str) -> bool:
    """Whether one loop (a for statement or a comprehension) both sends with rpc_async and waits (.wait())."""
    tree = _parsed(source)
    loops = (ast.For, ast.While, ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)
    for loop in (node for node in ast.walk(tree or ast.Module(body=[], type_ignores=[])) if isinstance(node, loops)):
        text = ast.unparse(loop)
        if "rpc_async" in text and ".wait()" in text:
            return True
    return False


def _lock_around_slow_work(source: str) -> bool:
    """Whether Counter.add holds a `with` block (the lock) around its time.sleep(0.1)."""
    tree = _parsed(source)
    for cls in (tree.body if tree else []):
        if isinstance(cls, ast.ClassDef) and cls.name == "Counter":
            for node in ast.walk(cls):
                if isinstance(node, ast.With) and "time.sleep(0.1)" in ast.unparse(node):
                    return True
    return False


def step_locks() -> dict[str, list[str]]:
    """The `with` statements in each remote optimizer's `step` whose context manager is a threading lock, read from
    the installed torch with `ast`: {class name: [lock expressions]}."""
    from torch.distributed.optim import optimizer as distributed_optimizer

    def locks_taken(method) -> list[str]:
        tree = ast.parse(textwrap.dedent(inspect.getsource(method)))
        managers = [ast.unparse(item.context_expr) for node in ast.walk(tree) if isinstance(node, ast.With)
                    for item in node.items]
        return [m for m in managers if isinstance(eval(m, vars(distributed_optimizer)), type(threading.Lock()))]

    return {cls.__name__: locks_taken(cls.step)
            for cls in (distributed_optimizer._FunctionalLocalOptimizer, distributed_optimizer._LocalOptimizer)}
