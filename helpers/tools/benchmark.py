"""How long a 2-rank gloo all_reduce job takes to launch: helpers.launch against a bare torchrun; and how long a
trivial %%ranks cell takes on 2 live ranks.

    python -m helpers.tools.benchmark            # 5 rounds, alternating, prints medians and the ratio
    python -m helpers.tools.benchmark --rounds 9 --fresh
    python -m helpers.tools.benchmark --live     # a trivial %%ranks cell's round trip, kernel to 2 ranks and back

Both run helpers/workers/allreduce_demo.py on the same machine in the same session, alternating so
that background load hits both alike. The launch server's one-time start (import torch once) is
reported apart: it is paid once per notebook kernel, not per launch.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from helpers import WORKERS
from helpers.kit.timing import take_turns
from helpers.launcher.api import launch, start_launch_server

SCRIPT = WORKERS / "allreduce_demo.py"

def time_bare_torchrun(nproc: int = 2) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    str(SCRIPT)], check=True, capture_output=True)
    return time.perf_counter() - started

def time_launch(fresh: bool = False, nproc: int = 2) -> float:
    started = time.perf_counter()
    launch(SCRIPT, nproc=nproc, echo=False, fresh=fresh)
    return time.perf_counter() - started

def compare(rounds: int = 5, fresh: bool = False) -> dict[str, float]:
    """Median seconds per job for each way of launching, and helpers.launch / bare torchrun."""
    server_start = start_launch_server()
    bare, ours, ours_fresh = [], [], []
    for _ in range(rounds):
        bare.append(time_bare_torchrun())
        ours.append(time_launch())
        if fresh:
            ours_fresh.append(time_launch(fresh=True))
    result = {"bare torchrun": statistics.median(bare), "helpers.launch": statistics.median(ours),
              "launch server start (once per kernel)": server_start}
    if fresh:
        result["helpers.launch(fresh=True)"] = statistics.median(ours_fresh)
    result["ratio"] = result["helpers.launch"] / result["bare torchrun"]
    return result

def live_round_trip(rounds: int = 20, cells: int = 10) -> dict[str, str]:
    """A trivial cell (`pass`) on 2 live ranks, run as a learner runs it (the %%ranks magic in an IPython shell):
    seconds from the kernel sending it to every rank's answer and their output shown. Each round is `cells` cells in
    a row; the timing protocol gives the median and spread of the rounds, wall and the kernel's CPU."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "helpers")
    shell.run_line_magic("ranks", "start -n 2")
    try:
        cell = {"trivial %%ranks cell": lambda: shell.run_cell_magic("ranks", "", "pass")}
        timing = take_turns(cell, rounds=rounds, warmup=2, repeat=cells)["trivial %%ranks cell"]
    finally:
        shell.run_line_magic("ranks", "stop")
    return {"trivial %%ranks cell, 2 ranks (wall)": timing.summary(),
            "trivial %%ranks cell, 2 ranks (kernel CPU)": timing.summary("cpu")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="also time fresh-interpreter launches")
    parser.add_argument("--live", action="store_true", help="time a trivial %%%%ranks cell on 2 live ranks instead")
    options = parser.parse_args()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        try:
            if options.live:
                for name, value in live_round_trip(max(options.rounds, 5)).items():
                    print(f"{name:<45} {value}")
                return
            result = compare(options.rounds, options.fresh)
        finally:
            os.chdir(here)  # IPython's exit handler reads the working directory
    for name, value in result.items():
        print(f"{name:<40} {value:8.3f}" + (" s" if name != "ratio" else " x"))


if __name__ == "__main__":
    main()
