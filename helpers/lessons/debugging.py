"""Lesson 08's library (debugging clinic): readers for what the planted bugs leave, and the exercise's check.

The cross-rank checks that workers call (diverged_tensors, nonfinite_ranks) are in helpers/kit/instruments.py.

    own_fingerprints(run)                      # what TORCH_DISTRIBUTED_DEBUG=DETAIL says each rank was running
    read_flight_records(folder)                # the Flight Recorder dumps a worker wrote, per rank
    repair_gloo_dump(folder, out)              # make gloo dumps readable by torch's fr_trace analyser
    run_fr_trace(folder, prefix)               # torch's fr_trace analyser on those dumps, in this process
    check_mystery(rank, step, op, model_file)  # the exercise's check (launches the job with the learner's model)
    run_with_progress(command, ...)            # a subprocess that says every few seconds that it still runs
    wait_until_step(job, step)                 # a started job whose every rank has reported `step`
    worker_pids(job)                           # rank -> pid of a started job's live workers
    main_thread_frames(dump, script)           # a py-spy or faulthandler dump, main thread, down to `script`
    watchdog_dumps(log, script)                # the stacks faulthandler.dump_traceback_later left in a rank's log
    torchrun_summary(output)                   # torchrun's ChildFailedError summary, times/hosts/pids masked
"""
from __future__ import annotations

import math
import pickle
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from helpers import WORKERS, LaunchTimeout, WorkerFailed, launch
from helpers.kit.debugging import PER_RANK_BATCH, STEPS, WORLD_SIZE, Classifier, images, order
from helpers.lessons.checks import announce_run, correct, not_yet, not_yet_crashed

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


def reference_losses(lr: float = 0.5) -> dict[int, list[float]]:
    """The mystery job's losses per rank and step, computed in this process: the job's own Classifier, the same
    seed, batches and SGD, with the gradient of the mean of the ranks' losses (what DDP's averaged all-reduce gives).
    NaN from the step after the planted one on."""
    torch.manual_seed(0)
    model = Classifier()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    x_all, labels_all = images()
    orders = [order(rank) for rank in range(WORLD_SIZE)]
    losses: dict[int, list[float]] = {rank: [] for rank in range(WORLD_SIZE)}
    for step in range(1, STEPS + 1):
        total = torch.zeros(())
        for rank in range(WORLD_SIZE):
            batch = orders[rank][(step - 1) * PER_RANK_BATCH:step * PER_RANK_BATCH]
            loss = torch.nn.functional.cross_entropy(model(x_all[batch]), labels_all[batch])
            losses[rank].append(loss.item())
            total = total + loss
        optimizer.zero_grad()
        (total / WORLD_SIZE).backward()
        optimizer.step()
    return losses


MYSTERY_OP = "PowBackward0"  # the backward anomaly mode names: the square's 2 * h (= 0) times sqrt's infinite slope


def _same_op(answer: str, op: str) -> bool:
    def plain(name: str) -> str:
        return name.strip().strip("'\"`").lower().removesuffix("0")
    return plain(answer) == plain(op)


def check_mystery(rank: int | None, step: int | None, backward_op: str | None = None,
                  model_file: str | Path | None = None, timeout: float = 60.0) -> bool:
    """The exercise: the rank and step where the mystery job's NaN was born, the backward function that made it,
    and a fixed copy of the job's model, which this check launches the job with."""
    true_rank, true_step = planted()
    if rank is None or step is None or backward_op is None:
        return not_yet("set `rank` and `step` to where the first NaN was born (before the all-reduce spread it), "
                       "and `backward_op` to the backward function that made it")
    if (rank, step) != (true_rank, true_step):
        if step == true_step + 1:
            return not_yet(f"rank {rank}, step {step} is not where it starts; every rank's loss turns NaN one "
                           "step *after* the bad backward: look for a tool that names the rank whose backward "
                           "made the first NaN")
        return not_yet(f"rank {rank}, step {step} is not where the first NaN was born. The loss log and the NaN "
                       "flag show where a NaN *arrived*; use the tool that stops in the backward that made it: the "
                       "rank that raises, and the last step that rank printed")
    if not _same_op(backward_op, MYSTERY_OP):
        if _same_op(backward_op, "SqrtBackward0"):
            return not_yet("SqrtBackward0 is where the code suggests looking, but at 0 sqrt's backward returns inf, "
                           "not NaN: name the backward function that anomaly mode says returned NaN")
        return not_yet(f"`backward_op` {backward_op!r} is not the backward function that made the NaN: anomaly "
                       "mode names it (\"Function '...' returned nan values\")")
    if model_file is None:
        return not_yet(f"diagnosis right (rank {rank}, step {step}, {MYSTERY_OP}); now fix the model in your copy "
                       "and pass its file as `model_file`")
    path = Path(model_file).resolve()
    if not path.is_file():
        return not_yet(f"there is no file {model_file}: run the %%writefile cell that makes your copy first")
    announce_run(f"the mystery job with your {path.name}", WORLD_SIZE, timeout, stop_after=20)
    try:
        run = launch(WORKERS / "debug_mystery.py", nproc=WORLD_SIZE, args=["--model", str(path)], echo=False,
                     timeout=timeout)
    except (WorkerFailed, LaunchTimeout) as error:
        return not_yet_crashed(error, f"the mystery job with {path.name}")
    finished = sorted(r for r, values in run.results.items() if values.get("steps") == STEPS)
    if finished != list(range(WORLD_SIZE)):
        return not_yet(f"the fixed run must finish all {STEPS} steps on every rank; finished: {finished}")
    losses = {r: values["losses"] for r, values in sorted(run.results.items())}
    final = [values[-1] for values in losses.values()]
    if not all(math.isfinite(loss) for loss in final):
        return not_yet(f"the job ran with your {path.name}, but its final losses are not finite: {final}. A NaN is "
                       "still born in a backward: which operation of your model has an infinite slope, and where?")
    reference = reference_losses()
    for number in range(1, true_step + 1):  # where the original's losses were finite
        for r in range(WORLD_SIZE):
            yours, original = losses[r][number - 1], reference[r][number - 1]
            if abs(yours - original) > 1e-4:
                return not_yet(f"with your model the loss of step {number} on rank {r} is {yours:.4f}, the "
                               f"original's {original:.4f}: your change alters what the model computes where there "
                               "was no NaN. Change only what happens at a length of 0")
    return correct(f"the NaN was born on rank {rank} at step {step}, in {MYSTERY_OP} (the square's 2h = 0 times "
                   f"sqrt's infinite slope at 0); with your {path.name} the job ran all {STEPS} steps with finite "
                   f"losses on every rank, and the original's losses up to step {true_step}")


def run_fr_trace(folder: str | Path, prefix: str) -> str:
    """`python -m torch.distributed.flight_recorder.fr_trace FOLDER -p PREFIX`, run in this process (torch is
    already imported here, so this saves a new interpreter); returns what it printed, and its error if any."""
    import contextlib
    import io
    import logging

    with contextlib.redirect_stderr(io.StringIO()):  # its import says tabulate is missing; not needed here
        from torch.distributed.flight_recorder import fr_trace
    printed = io.StringIO()
    handlers = logging.getLogger("Flight Recorder").handlers  # the analyser reports through this logger
    before = [handler.setStream(printed) for handler in handlers]
    try:
        fr_trace.main([str(folder), "-p", prefix])
    except Exception as error:  # what the command line would end with
        printed.write(f"{type(error).__name__}: {error}\n")
    finally:
        for handler, stream in zip(handlers, before, strict=True):
            handler.setStream(stream)
    return printed.getvalue()


def run_with_progress(command: list[str], every: float = 3.0, timeout: float = 120.0,
                      **options: Any) -> subprocess.CompletedProcess:
    """subprocess.run(command, capture_output=True, text=True), printing a line every `every` seconds while it
    runs, so that a cell that waits for fresh interpreters is never silent for long."""
    started = time.monotonic()
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **options) as process:
        while True:
            try:
                out, err = process.communicate(timeout=every)
                break
            except subprocess.TimeoutExpired:
                waited = time.monotonic() - started
                if waited > timeout:
                    process.kill()
                    process.communicate()
                    raise
                print(f"  ... still running ({waited:.0f} s)", flush=True)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


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
