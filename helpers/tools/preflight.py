"""Is this machine (or hub image) ready for the lessons? Checks it in well under a minute.

    python -m helpers.tools.preflight            # from the repository's root
    python -m helpers.tools.preflight --online   # also try to download MNIST (else the shipped digits are used)

Each line says OK, NOTE (works, but read this) or FIX (what to do). The exit status is 1 if anything
needs fixing. Run it on the workshop image before the day, and once on one learner's session.
"""
from __future__ import annotations

import argparse
import os
import platform
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from helpers import REPO_ROOT as ROOT
from helpers.lessons.system import pinned, usable_cores

GIB = 1024**3


def _pinned_or_none(package: str) -> str | None:
    try:
        return pinned(package)
    except (KeyError, OSError):  # a copy without requirements.txt, or a package it does not pin
        return None


def memory_limit_bytes() -> int:
    """The memory this session may use: the cgroup limit on a hub or container, else what is available."""
    import psutil

    available = psutil.virtual_memory().available
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return min(available, int(text))
    return available


def check_python() -> tuple[str, str]:
    version = platform.python_version()
    if sys.version_info < (3, 10):  # noqa: UP036 (this check exists for the machines that fail it)
        return "FIX", f"Python {version}: the lessons need 3.10 or newer"
    return "OK", f"Python {version}"


def check_torch() -> tuple[str, str]:
    try:
        import torch
    except ImportError:
        return "FIX", "torch is not installed: pip install -r requirements.txt"
    wanted = _pinned_or_none("torch")
    have = torch.__version__.split("+")[0]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    where = f"{gpus} GPU(s): workers will use nccl" if gpus else "no GPU: workers use gloo on the CPU (expected)"
    if wanted and have != wanted:
        return "NOTE", f"torch {torch.__version__}, the lessons are tested with {wanted}; {where}"
    return "OK", f"torch {torch.__version__}; {where}"


def check_cores() -> tuple[str, str]:
    cores = usable_cores()
    budget = os.environ.get("LESSONS_CPUS")
    text = f"{cores} usable core(s)" + (f", LESSONS_CPUS={budget} per learner" if budget else "")
    if cores < 2 and not budget:
        return "NOTE", text + ": lessons launch 2-4 processes; they run, but timings will say little"
    return "OK", text


def check_memory() -> tuple[str, str]:
    limit = memory_limit_bytes()
    if limit < 2 * GIB:
        return "FIX", f"{limit / GIB:.1f} GiB available: a learner needs about 2 GiB (see the facilitator guide)"
    return "OK", f"{limit / GIB:.1f} GiB available to this session"


def check_loopback() -> tuple[str, str]:
    try:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
    except OSError as error:
        return "FIX", f"cannot open a TCP port on 127.0.0.1 ({error}): rendezvous needs loopback networking"
    span = ""
    ports = Path("/proc/sys/net/ipv4/ip_local_port_range")
    if ports.exists():
        low, high = map(int, ports.read_text().split())
        span = f"; free ports come from {low}-{high} ({high - low + 1} ports)"
    return "OK", f"loopback port {port} could be opened{span}"


def check_runs_folder() -> tuple[str, str]:
    folder = ROOT / "notebooks" / "runs"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as error:
        return "FIX", f"cannot write to notebooks/runs ({error}): per-rank logs and checkpoints go there"
    return "OK", "notebooks/runs is writable (per-rank logs and checkpoints go there)"


def check_data(online: bool) -> tuple[str, str]:
    from helpers.kit import data

    if online:
        source = data.prepare()
    else:
        present = data._mnist_present(data.DATA_ROOT)
        source = data.MNIST_NAME if present and data._wanted() != "digits" else data.DIGITS_NAME
    train, _ = data.load(train=True)
    if source == data.DIGITS_NAME:
        return "NOTE", (f"lessons will use the shipped digits ({len(train)} training images); with internet, "
                        f"`python -m helpers.tools.preflight --online` downloads MNIST once into data/")
    return "OK", f"{source}: {len(train)} training images"


def shared_kernels(processes: Iterable[dict], me: str, my_network: str | None) -> list[str]:
    """Other users' Jupyter kernels that share this network namespace (their jobs can reach ours, and ours theirs).

    processes: dicts with `username`, `cmdline` (a list) and `network` (the /proc/PID/ns/net link, None where it
    cannot be read, as for another user's process without root: then it may be shared, and counts)."""
    return sorted({p["username"] for p in processes
                   if p["username"] != me and any("ipykernel" in part for part in p["cmdline"] or [])
                   and (p["network"] is None or p["network"] == my_network)})


def _processes() -> Iterator[dict]:
    import psutil

    for process in psutil.process_iter(["username", "cmdline"]):
        try:
            network = os.readlink(f"/proc/{process.pid}/ns/net")
        except OSError:
            network = None
        yield {**process.info, "network": network}


def check_neighbours() -> tuple[str, str]:
    import getpass

    try:
        mine = os.readlink("/proc/self/ns/net")
    except OSError:
        return "OK", "cannot see network namespaces here (not Linux): nothing to compare"
    others = shared_kernels(_processes(), getpass.getuser(), mine)
    if others:
        return "NOTE", (f"Jupyter kernels of {len(others)} other user(s) share this machine's loopback: their jobs "
                        "can reach this learner's (no authentication in torch.distributed); see docs/facilitator.md, "
                        "'Isolation between learners'")
    return "OK", "no other user's Jupyter kernel shares this network namespace"


def check_launch() -> tuple[str, str]:
    from helpers import launch

    started = time.perf_counter()
    run = launch(ROOT / "helpers" / "workers" / "whoami.py", nproc=2, timeout=120, echo=False)
    seconds = time.perf_counter() - started
    sums = sorted(run.results[rank]["rank_sum"] for rank in run.results)
    if sums != [1.0, 1.0]:
        return "FIX", f"a 2-rank all_reduce gave {sums}, not [1.0, 1.0]: the process group is broken"
    return "OK", f"a 2-rank launch with one all_reduce took {seconds:.1f} s (launch server start included)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--online", action="store_true", help="try to download MNIST")
    args = parser.parse_args()
    checks: list[tuple[str, Callable[[], tuple[str, str]]]] = [
        ("python", check_python), ("torch", check_torch), ("cores", check_cores), ("memory", check_memory),
        ("loopback", check_loopback), ("neighbours", check_neighbours), ("runs folder", check_runs_folder),
        ("data", lambda: check_data(args.online)), ("launch", check_launch),
    ]
    worst = "OK"
    for name, check in checks:
        try:
            status, text = check()
        except Exception as error:  # a check that breaks is itself something to fix
            status, text = "FIX", f"{type(error).__name__}: {error}"
        print(f"{status:<4} {name:<12} {text}", flush=True)
        if status == "FIX" or (status == "NOTE" and worst == "OK"):
            worst = status
    print({"OK": "Ready.", "NOTE": "Ready (read the notes).", "FIX": "Not ready: fix the FIX lines."}[worst])
    return 1 if worst == "FIX" else 0


if __name__ == "__main__":
    sys.exit(main())
