"""How long a 2-rank gloo all_reduce job takes to launch: helpers.launch against a bare torchrun.

    python -m helpers.tools.benchmark            # 5 rounds, alternating, prints medians and the ratio
    python -m helpers.tools.benchmark --rounds 9 --fresh

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
from helpers.launcher.api import launch, start_launch_server

SCRIPT = WORKERS / "allreduce_demo.py"

def time_bare_torchrun() -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(SCRIPT)], check=True, capture_output=True)
    return time.perf_counter() - started

def time_launch(fresh: bool = False) -> float:
    started = time.perf_counter()
    launch(SCRIPT, nproc=2, echo=False, fresh=fresh)
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

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fresh", action="store_true", help="also time fresh-interpreter launches")
    options = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        os.chdir(folder)
        result = compare(options.rounds, options.fresh)
    for name, value in result.items():
        print(f"{name:<40} {value:8.3f}" + (" s" if name != "ratio" else " x"))


if __name__ == "__main__":
    main()
