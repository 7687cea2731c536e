"""Lesson 08's library (debugging clinic): readers for what the planted bugs leave, and the exercise's check.

The cross-rank checks that workers call (diverged_tensors, nonfinite_ranks) are in helpers/kit/instruments.py.

    own_fingerprints(run)                      # what TORCH_DISTRIBUTED_DEBUG=DETAIL says each rank was running
    read_flight_records(folder)                # the Flight Recorder dumps a worker wrote, per rank
    repair_gloo_dump(folder, out)              # make gloo dumps readable by torch's fr_trace analyser
    check_mystery(rank, step, fixed_run)       # the exercise's check
    wait_until_step(job, step)                 # a started job whose every rank has reported `step`
    worker_pids(job)                           # rank -> pid of a started job's live workers
    main_thread_frames(dump, script)           # a py-spy or faulthandler dump, main thread, down to `script`
    watchdog_dumps(log, script)                # the stacks faulthandler.dump_traceback_later left in a rank's log
    torchrun_summary(output)                   # torchrun's ChildFailedError summary, times/hosts/pids masked
"""
from __future__ import annotations

import pickle
import re
import time
from pathlib import Path
from typing import Any

from helpers.kit.debugging import PER_RANK_BATCH, STEPS, WORLD_SIZE, images, order
from helpers.lessons.checks import correct, not_yet

_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+),? ?"
                          r"OpType=(\w+)(?:, TensorShape=\[([^\]]*)\], TensorDtypes=(\w+))?")


def rank_errors(run: Any) -> dict[int, str]:
    """Every rank's own traceback from a failed run (the launcher keeps them in its run folder)."""
    return run.tracebacks()


def own_fingerprints(run: Any) -> dict[int, dict[str, Any]]:
    """Per rank, the collective that rank itself was running when DETAIL mode found a mismatch.

    DETAIL's message also prints the *other* rank's fingerprint, but when the two serialized fingerprints
    differ in length, the check compares the lengths first and the message decodes the other rank's length
    tensor as a fingerprint (an operation numbered by that length, sequence number 0; see
    CollectiveFingerPrint::verify in torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp). A rank's own
    fingerprint is always right.
    """
    found = {}
    for rank, text in rank_errors(run).items():
        for match in _FINGERPRINT.finditer(text):
            if int(match.group(1)) == rank:
                shape = match.group(4)
                found[rank] = {"sequence": int(match.group(2)), "op": match.group(3),
                               "shape": None if shape is None else [int(s) for s in shape.split(",") if s.strip()],
                               "dtype": match.group(5)}
                break
    return found


def read_flight_records(folder: str | Path) -> dict[int, dict[str, Any]]:
    """The Flight Recorder dumps in `folder` (files rank0, rank1, ... as the debug workers write them)."""
    records = {}
    for path in sorted(Path(folder).glob("rank*")):
        with open(path, "rb") as file:
            records[int(path.name.removeprefix("rank"))] = pickle.load(file)
    return records


def last_collective(record: dict[str, Any], script: str) -> dict[str, Any]:
    """The newest entry of one rank's dump: its sequence number, op, tensor sizes, and its line in `script`."""
    entry = record["entries"][-1]
    line = next((frame["line"] for frame in entry["frames"] if frame["filename"].endswith(script)), None)
    return {"sequence": entry["collective_seq_id"], "op": entry["profiling_name"], "sizes": entry["input_sizes"],
            "line": line}


def repair_gloo_dump(folder: str | Path, out: str | Path) -> list[str]:
    """Copy gloo dumps to `out` as trace_<rank>, naming the group in pg_config as the entries do.

    With torch 2.14 a gloo dump lists its default group under the name '' in pg_config, while every entry
    says it belongs to group '0'; torch.distributed.flight_recorder.fr_trace then stops with KeyError ('0', 0).
    Returns the names that were renamed.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    renamed = set()
    for rank, record in read_flight_records(folder).items():
        used = {entry["process_group"][0]: entry["process_group"][1] for entry in record["entries"]}
        config = dict(record["pg_config"])
        if "" in config and len(used) == 1:
            name, description = next(iter(used.items()))
            config[name] = dict(config.pop(""), name=name, desc=description)
            renamed.add(name)
        with open(out / f"trace_{rank}", "wb") as file:
            pickle.dump(dict(record, pg_config=config), file)
    return sorted(renamed)


def planted() -> tuple[int, int]:
    """(rank, step) of the blank image: the exercise check compares a learner's diagnosis with this."""
    blank = int((images()[0].abs().sum(1) == 0).nonzero()[0])
    rank = next(r for r in range(WORLD_SIZE) if blank in order(r))
    return rank, order(rank).index(blank) // PER_RANK_BATCH + 1


def check_mystery(rank: int | None, step: int | None, fixed_run: Any = None) -> bool:
    """The exercise: the rank and step where the mystery job's NaN was born, and a fixed run that finishes."""
    true_rank, true_step = planted()
    if rank is None or step is None:
        return not_yet("set `rank` and `step` to where the first NaN was born (before the all-reduce spread it)")
    if (rank, step) != (true_rank, true_step):
        if step != true_step:
            return not_yet(f"rank {rank}, step {step} is not where it starts; every rank's loss turns NaN one "
                           "step *after* the bad backward: look for a tool that names the rank whose backward "
                           "made the first NaN")
        return not_yet(f"step {step} is right, but the NaN was not born on rank {rank}")
    if fixed_run is None or not hasattr(fixed_run, "results"):
        return not_yet(f"diagnosis right (rank {rank}, step {step}); now launch the fixed job and pass its Run "
                       "as `fixed_run`")
    finished = sorted(r for r, values in fixed_run.results.items() if values.get("steps") == STEPS)
    losses = [values.get("final_loss") for values in fixed_run.results.values()]
    if finished != list(range(fixed_run.nproc)):
        return not_yet(f"the fixed run must finish all {STEPS} steps on every rank; finished: {finished}")
    if not all(isinstance(loss, float) and loss == loss and abs(loss) != float("inf") for loss in losses):
        return not_yet(f"the fixed run finished, but its final losses are not finite: {losses}")
    return correct(f"the NaN was born on rank {rank} at step {step}, and the fixed job ran all {STEPS} steps "
                   f"with finite losses on every rank")


def wait_until_step(job: Any, step: int, limit: float = 30.0) -> None:
    """Return once every rank of a started job has reported `step` (the readiness signal of a planted hang)."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        job.tick()
        reported = {row["rank"] for row in job.folder.metrics if row.get("step") == step}
        if len(reported) == job.spec["nproc"]:
            return
        if job.agent.poll() is not None:
            raise RuntimeError(f"the job ended before every rank reached step {step}: {job.run_dir}")
        time.sleep(0.05)
    raise TimeoutError(f"not every rank reached step {step} within {limit:g} s")


def worker_pids(job: Any) -> dict[int, int]:
    """rank -> process id of each live worker of a started job (on a cluster: `pgrep -f train.py`, or
    `pgrep -P <torchrun's pid>`; torchrun logs its workers' pids only as the job ends, even with LOGLEVEL=INFO)."""
    return job.folder.live_worker_pids()


_PY_SPY_FRAME = re.compile(r"^\s+(\S+) \(([^:()]+):(\d+)\)$")
_FAULTHANDLER_FRAME = re.compile(r'^\s+File "([^"]+)", line (\d+) in (\S+)$')


def main_thread_frames(dump: str, script: str) -> list[str]:
    """The main thread's Python frames in a py-spy dump or a faulthandler dump, innermost first, as
    "function (file:line)", down to `script`'s top level (what lies below it is the launcher's machinery)."""
    frames = []
    in_main = False
    for line in dump.splitlines():
        if line.startswith(("Thread ", "Current thread ")):
            in_main = "MainThread" in line or line.startswith("Current thread ")
            continue
        if not in_main:
            continue
        py_spy, fault = _PY_SPY_FRAME.match(line), _FAULTHANDLER_FRAME.match(line)
        if py_spy:
            function, file, number = py_spy.groups()
        elif fault:
            file, number, function = fault.groups()
        else:
            continue
        frames.append(f"{function} ({Path(file).name}:{number})")
        if function == "<module>" and Path(file).name == Path(script).name:
            break
    return frames


def watchdog_dumps(log: str, script: str) -> list[list[str]]:
    """The stacks `faulthandler.dump_traceback_later` wrote into a rank's log, one per dump: each the frames, innermost
    first ("function (file:line)"), of the thread that runs `script` (a watchdog dump names no thread "Current
    thread": it is written from faulthandler's own thread), down to `script`'s top level."""
    dumps = []
    for dump in log.split("Timeout (")[1:]:
        frames: list[str] = []
        for line in dump.splitlines()[1:]:
            if line.startswith("Thread "):
                frames = []  # a new thread's stack begins
                continue
            fault = _FAULTHANDLER_FRAME.match(line)
            if not fault:
                if line.strip() and not line.startswith(" "):
                    break  # a line that is not part of the dump: it has ended
                continue
            file, number, function = fault.groups()
            frames.append(f"{function} ({Path(file).name}:{number})")
            if function == "<module>" and Path(file).name == Path(script).name:
                dumps.append(frames)
                break
    return dumps


def torchrun_summary(output: str) -> str:
    """The ChildFailedError block torchrun prints when a rank fails, with times, host names, process ids and
    temporary paths masked (they differ on every run)."""
    start = output.index("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    block = output[start:output.index("=" * 60, output.index("Root Cause", start)) + 60]
    block = re.sub(r"time      : \S+", "time      : <time>", block)
    block = re.sub(r"host      : \S+", "host      : <host>", block)
    block = re.sub(r"pid: \d+", "pid: <pid>", block)
    block = re.sub(r"PID \d+", "PID <pid>", block)
    return re.sub(r"/tmp/torchelastic_\S+", "<error file>", block)
