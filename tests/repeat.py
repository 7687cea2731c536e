"""Run the whole suite N times and print which tests failed in which run: the flakiness check.

    python tests/repeat.py 5                   # five runs of `pytest --nbval`, one after another
    python tests/repeat.py 1 --load            # one run while another process keeps a core busy
    python tests/repeat.py 3 -- tests/test_launch.py -x   # extra pytest arguments after --

Use it before resolving anything that touches timing or the launcher: a suite that fails one time in
three teaches teachers to ignore it. Each run writes a JUnit XML file under runs/repeat/; the table at
the end lists every test that failed at least once, with the runs it failed in and its first message.
Each run also prints where its time went, from pytest's own timings: the notebooks' items, the tests in tests/,
and the whole run as a multiple of the notebooks (issue 38 keeps it at 1.5x or less), then the slowest files.

    python tests/repeat.py --times runs/repeat/run1.xml   # that summary again, from any JUnit file
"""
from __future__ import annotations

import argparse
import multiprocessing
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from helpers import REPO_ROOT as ROOT


def _busy(stop_at: float) -> None:
    """A CPU-heavy neighbour, like a browser or another learner's kernel on a shared server."""
    x = 0
    while time.time() < stop_at:
        x = (x * 31 + 7) % 1_000_003


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """test id -> (outcome, first line of the message) from one pytest JUnit XML file."""
    found = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test_id = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            element = case.find(kind)
            if element is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[kind]
                message = (element.get("message") or element.text or "").strip().splitlines()[:1]
                message = message[0][:160] if message else ""
                break
        found[test_id] = (outcome, message)
    return found


def seconds_by_file(junit: Path) -> dict[str, float]:
    """file -> seconds pytest spent on its items (setup, call and teardown), from one JUnit XML file. A notebook's
    items are its cells (classname notebooks.NN_name.ipynb); a test's file is its module (tests.fast.test_x)."""
    seconds: dict[str, float] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        classname = case.get("classname") or ""
        if ".ipynb" in classname:
            name = classname.replace(".", "/", 1)
        else:
            name = "/".join(part for part in classname.split(".") if not part[:1].isupper()) + ".py"
        seconds[name] = seconds.get(name, 0.0) + float(case.get("time") or 0)
    return seconds


def time_summary(junit: Path, slowest: int = 8) -> str:
    """Where a run's time went: the notebooks' items, tests/, the whole session (pytest's own duration, collection
    included) as a multiple of the notebooks, and the slowest files."""
    seconds = seconds_by_file(junit)
    whole = sum(float(suite.get("time") or 0) for suite in ET.parse(junit).getroot().iter("testsuite"))
    notebooks = sum(t for name, t in seconds.items() if name.endswith(".ipynb"))
    tests = sum(t for name, t in seconds.items() if not name.endswith(".ipynb"))
    ratio = f"{whole / notebooks:.2f}x the notebooks" if notebooks else "no notebooks in this run"
    lines = [f"  time: the whole session {whole:.0f} s ({ratio}): notebooks' items {notebooks:.0f} s, tests/ "
             f"{tests:.0f} s; slowest files:"]
    for name, spent in sorted(seconds.items(), key=lambda item: -item[1])[:slowest]:
        lines.append(f"    {spent:6.1f} s  {name}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=int, nargs="?", default=5)
    parser.add_argument("--times", type=Path, metavar="JUNIT", help="only print where that run's time went")
    parser.add_argument("--load", action="store_true", help="keep one core busy with another process meanwhile")
    parser.add_argument("pytest_args", nargs="*", help="extra arguments for pytest (after --)")
    args = parser.parse_args()
    if args.times:
        print(time_summary(args.times))
        return 0
    folder = ROOT / "runs" / "repeat"
    folder.mkdir(parents=True, exist_ok=True)
    failures: dict[str, list[tuple[int, str]]] = {}
    summary = []
    for run in range(1, args.runs + 1):
        junit = folder / f"run{run}.xml"
        neighbour = None
        if args.load:
            neighbour = multiprocessing.Process(target=_busy, args=(time.time() + 24 * 3600,), daemon=True)
            neighbour.start()
        started = time.perf_counter()
        code = subprocess.call([sys.executable, "-m", "pytest", "--nbval", "-q", f"--junitxml={junit}",
                                *args.pytest_args], cwd=ROOT)
        seconds = time.perf_counter() - started
        if neighbour is not None:
            neighbour.terminate()
            neighbour.join()
        results = outcomes(junit) if junit.exists() else {}
        kinds = ("passed", "failed", "error", "skipped")
        counts = {kind: sum(o == kind for o, _ in results.values()) for kind in kinds}
        summary.append((run, code, seconds, counts))
        for test_id, (outcome, message) in results.items():
            if outcome in ("failed", "error"):
                failures.setdefault(test_id, []).append((run, message))
        print(f"run {run}: exit {code}, {counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['error']} errors, {counts['skipped']} skipped in {seconds:.0f} s"
              + (" (with a busy neighbour)" if args.load else ""), flush=True)
        if results:
            print(time_summary(junit), flush=True)
    print("\nrun  exit  passed  failed  errors  skipped  seconds")
    for run, code, seconds, counts in summary:
        print(f"{run:>3}  {code:>4}  {counts['passed']:>6}  {counts['failed']:>6}  {counts['error']:>6}  "
              f"{counts['skipped']:>7}  {seconds:>7.0f}")
    if failures:
        print("\nFailed at least once:")
        for test_id, seen in sorted(failures.items()):
            print(f"  {test_id}: runs {[run for run, _ in seen]}: {seen[0][1]}")
    else:
        print("\nNo test failed in any run.")
    return 1 if failures or any(code != 0 for _, code, _, _ in summary) else 0


if __name__ == "__main__":
    sys.exit(main())
