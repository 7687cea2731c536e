"""Starting processes without helpers.launch: what goes wrong, shown by running it (lessons 00 and 02, appendix A0).

    from helpers.lessons.mp_spawn import mp_spawn_from_notebook, fork_probe, torchrun_in_a_terminal
    mp_spawn_from_notebook(work, nprocs=1, args=(1,))   # the source article's mp.spawn, from a notebook
    fork_probe()                 # may a child forked after torch.cuda.is_available() / device_count() use CUDA?
    torchrun_in_a_terminal("../helpers/workers/broken_demo.py", {"with @record": []})   # torchrun's own report
"""
from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from helpers import REPO_ROOT


def mp_spawn_from_notebook(function: Callable, nprocs: int = 2, args: tuple = ()) -> None:
    """Run the source article's ``mp.spawn(function, ...)`` and, when it fails, raise a short error
    that names what mp.spawn raised and adds the child's own last error line.

    A child that dies before torch's ``_wrap`` runs leaves no error file, so mp.spawn's exception says
    only "terminated with exit code 1"; the child's reason is on its stderr (fd 2, which ipykernel
    forwards into the cell as a separate wall of text, the children's lines interleaved). So each child
    starts through a two-line shell script that sends its stderr to a file of its own
    (``multiprocessing.set_executable``, which the spawn start method uses for every child), and the
    error keeps the last line the children wrote (they all fail alike; the first in sorted order, so the
    message does not depend on which child was faster)."""
    __tracebackhide__ = True
    import multiprocessing.spawn
    import sys

    import torch.multiprocessing as mp

    from helpers.launcher.api import stop_launch_server

    stop_launch_server(before="the spawned interpreter")
    # spawn logs "Terminating process <pid>" while cleaning up; the short error below says it all
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory() as folder:
        starter = os.path.join(folder, "python-with-own-stderr")
        with open(starter, "w") as file:
            file.write(f'#!/bin/sh\nexec "{sys.executable}" "$@" 2>"{folder}/stderr-$$.txt"\n')
        os.chmod(starter, 0o755)
        executable = multiprocessing.spawn.get_executable()
        multiprocessing.spawn.set_executable(starter)
        try:
            mp.spawn(function, args=args, nprocs=nprocs, join=True)
        except Exception as error:
            said = []
            for name in sorted(os.listdir(folder)):
                if name.startswith("stderr-"):
                    with open(os.path.join(folder, name)) as file:
                        lines = [line for line in file.read().splitlines() if line.strip()]
                    if lines:
                        said.append(lines[-1])
            child = sorted(said)[0] if said else "(no message)"
            code = getattr(error, "exit_code", "?")
            # from None: the chained ProcessExitedException would repeat torch's frames; its type and
            # message are in this one
            raise RuntimeError(f"mp.spawn raised {type(error).__name__} (a child exited with code {code}); "
                               f"the child's stderr said: {child}") from None
        finally:
            multiprocessing.spawn.set_executable(executable)


# Run in a fresh interpreter: fork a child before and after one call, and ask each child to initialise CUDA.
_FORK_PROBE = r"""
import json, os, sys
import torch

def forked_child_initialises_cuda():
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            torch.cuda.init()
            said = "CUDA initialised"
        except Exception as error:
            said = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        os.write(write_end, said.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    return said

before = forked_child_initialises_cuda()
eval(sys.argv[1])
after = forked_child_initialises_cuda()
nvml = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
print(json.dumps({"before": before, "after": after, "nvml_counted": nvml >= 0}))
"""

POISONED = "Cannot re-initialize CUDA in forked subprocess"


def _first_sentence(said: str) -> str:
    return said.split(". ")[0].rstrip(".")


def fork_probe(calls: tuple[str, ...] = ("torch.cuda.is_available()", "torch.cuda.device_count()")) -> list[dict]:
    """For each call, a fresh interpreter forks a child before it and one after it; each child tries
    `torch.cuda.init()`. Returns one row per case: what the parent had done, what the child said, and whether
    the child was refused as a forked subprocess. The interpreters run at the same time."""
    print(f"Starting {len(calls)} fresh Python processes, one per call (each imports torch: a few seconds) ...",
          flush=True)
    probes = [subprocess.Popen([sys.executable, "-c", _FORK_PROBE, call], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for call in calls]
    rows = []
    for call, probe in zip(calls, probes, strict=True):
        out, err = probe.communicate(timeout=300)
        if probe.returncode != 0:
            raise RuntimeError(f"the fork probe for {call} failed: {err.strip().splitlines()[-1:]}")
        found = json.loads(out.strip().splitlines()[-1])
        if not rows:
            rows.append({"parent did": "nothing with CUDA yet", "child said": _first_sentence(found["before"]),
                         "refused": POISONED in found["before"]})
        rows.append({"parent did": call, "child said": _first_sentence(found["after"]),
                     "refused": POISONED in found["after"], "nvml_counted": found["nvml_counted"]})
    return rows


def fork_this_process(parent_did: str = "this kernel") -> dict:
    """Fork a child from this process (the notebook's kernel) and let it try `torch.cuda.init()`. `parent_did`
    labels the row: what this process asked torch about CUDA before (the child inherits that)."""
    import torch

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, running none of the parent's cleanup
        os.close(read_end)
        try:
            torch.cuda.init()
            said = "CUDA initialised"
        except Exception as error:
            said = f"{type(error).__name__}: {str(error).strip().splitlines()[0]}"
        os.write(write_end, said.encode())
        os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end) as pipe:
        said = pipe.read()
    os.waitpid(pid, 0)
    return {"parent did": parent_did, "child said": _first_sentence(said),
            "refused": POISONED in said}


def _shorter(text: str) -> str:
    """A report without this machine's paths and name: torch's files as torch/..., the repository's relative."""
    import torch

    text = text.replace(str(Path(torch.__file__).parent), "torch").replace(f"{REPO_ROOT}/", "")
    text = re.sub(r"/\S*/torchelastic_\S*/error\.json", "<torchrun's temporary folder>/error.json", text)
    return text.replace(socket.gethostname(), "<this host>")


def failure_report(output: str) -> str:
    """The ChildFailedError report in torchrun's output: from its first line of '=' to its last."""
    lines = output.splitlines()
    edges = [index for index, line in enumerate(lines) if line and set(line) == {"="}]
    return "\n".join(lines[edges[0]:edges[-1] + 1]) if len(edges) >= 2 else ""


def root_cause(report: str) -> str:
    """The 'Root Cause (first observed failure)' block of a torchrun failure report."""
    start = report.find("Root Cause (first observed failure):")
    return report[start:].rstrip("=\n ") if start >= 0 else ""


def root_cause_fields(report: str) -> dict[str, str]:
    """The Root Cause entry's fields ("rank", "exitcode", "error_file", ...), each as torchrun printed it."""
    return dict(re.findall(r"^ {2}(\w+)\s*: (.*?)\s*$", root_cause(report), re.MULTILINE))


def torchrun_in_a_terminal(script: str | Path, variants: dict[str, list[str]], nproc: int = 2,
                           show: Callable[[str], bool] = lambda line: line.startswith("step ")) -> dict[str, str]:
    """Run `python -m torch.distributed.run --standalone --nproc-per-node nproc script ARGS` once per variant
    (name -> ARGS), one after the other, as a terminal would: fresh interpreters, no helpers.launch. Prints the
    workers' lines that `show` picks as they come, and returns each variant's whole output (stdout and stderr),
    with this machine's paths shortened."""
    from helpers.launcher.api import stop_launch_server

    stop_launch_server(before="torchrun's fresh interpreters")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    # The workers share one pipe. With PYTHONUNBUFFERED set (JupyterLab's environment may have it), print() writes a
    # line and its newline in two system calls, so two ranks' lines can glue ("step 0: sum 1.333step 0: ..."); without
    # it a flushed print is one write, whole on the pipe.
    env.pop("PYTHONUNBUFFERED", None)
    outputs: dict[str, str] = {}
    took = None
    for name, args in variants.items():
        command = ["torchrun", "--standalone", f"--nproc-per-node={nproc}", os.path.relpath(script, REPO_ROOT),
                   *map(str, args)]
        expect = (f"about as long as the last one, {took:.1f} s" if took is not None else
                  f"{nproc + 1} fresh interpreters, torchrun's and {nproc} workers', each import torch before the "
                  "first step; appendix A0 times such a launch against one forked from a launch server")
        print(f"[{name}] $ {' '.join(command)}   ({expect})", flush=True)
        started = time.perf_counter()
        process = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *command[1:]], cwd=REPO_ROOT,
                                   env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines: list[str] = []
        quiet = threading.Event()

        def heartbeat(name: str = name, started: float = started, quiet: threading.Event = quiet) -> None:
            while not quiet.wait(4):
                print(f"[{name}] still running after {time.perf_counter() - started:.0f} s", flush=True)

        beat = threading.Thread(target=heartbeat, daemon=True)
        beat.start()
        try:
            for line in process.stdout:
                lines.append(line)
                if show(line):
                    print(f"[{name}] {line.rstrip()}", flush=True)
            process.wait(timeout=300)
        finally:
            quiet.set()
            process.kill()
        took = time.perf_counter() - started
        print(f"[{name}] torchrun exited with code {process.returncode} after {took:.1f} s", flush=True)
        outputs[name] = _shorter("".join(lines))
    return outputs
