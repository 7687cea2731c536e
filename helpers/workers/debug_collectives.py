"""Collectives that do not match across ranks: a hang, silent garbage, a crash, and the tools that show each.

    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_collectives.py --bug skip-barrier
    TORCH_DISTRIBUTED_DEBUG=DETAIL torchrun --standalone --nproc-per-node 2 \
        helpers/workers/debug_collectives.py --bug skip-barrier --timeout 10

The clinic's bugs are CPU cases: the worker asks for gloo (and CPU tensors) even where GPUs are present.

Every step all-reduces a "gradient" (8 numbers) and the number of samples seen; every --checkpoint-every steps
the ranks meet at a barrier, as before writing a checkpoint. One planted bug at a time (--bug):
  skip-barrier  rank 1 skips the barrier at the first checkpoint (it sits under `if rank == 0:` by mistake)
  dtype         rank 1 counts its samples in int64, rank 0 in float64: same size in bytes, different meaning
  shape         rank 1's gradient has one number more (its model has one parameter more)
Tools: --monitored   monitored_barrier instead of barrier (gloo only): rank 0 names the ranks that never came
       TORCH_DISTRIBUTED_DEBUG=DETAIL (launch(..., debug=True)): each collective is compared across ranks first
       --flight-recorder DIR  each rank dumps torch's Flight Recorder (on by default: the last 2000
                              collectives; TORCH_FR_BUFFER_SIZE sizes it, 0 turns it off) to DIR/rank<N>
                              four times a second while it runs and at the end; when a collective raises, the
                              dumps stop, DIR/rank<N> becomes the last dump taken at least 0.5 s before the
                              error was caught (if any) and a last one goes to DIR/after_error/rank<N>
       --stacks-on-signal   faulthandler.register(SIGUSR1): `kill -USR1 <pid>` prints every thread's Python
                              stack to this rank's stderr (replaces the course launcher's own SIGUSR1 handler);
                              also allow_any_tracer(), so that py-spy may attach without root under ptrace_scope=1
       --watchdog S  faulthandler.dump_traceback_later(S, repeat=True), re-armed every step: a step that takes
                              longer than S seconds prints every thread's stack to stderr, every S seconds,
                              with nobody sending a signal (for the job that hangs at 3 a.m.)
       --timeout S   seconds a collective waits before it fails (gloo's default is 30 minutes)
"""
import argparse
import ctypes
import faulthandler
import os
import signal
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import report, result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bug", choices=["none", "skip-barrier", "dtype", "shape"], default="none")
    parser.add_argument("--steps", type=int, default=6)
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--per-rank-batch", type=int, default=16)
    batch.add_argument("--global-batch", type=int, default=None, help="split evenly across the ranks instead")
    parser.add_argument("--checkpoint-every", type=int, default=3)
    parser.add_argument("--monitored", action="store_true")
    parser.add_argument("--flight-recorder", default=None)
    parser.add_argument("--stacks-on-signal", action="store_true")
    parser.add_argument("--watchdog", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    return parser.parse_args()


def meet(args: argparse.Namespace) -> None:
    """All ranks wait for each other, as before a checkpoint."""
    if args.monitored:  # rank 0 collects every rank; after the timeout it names those that never came
        # half the collective timeout, so that rank 0 speaks before the other ranks' collectives time out
        dist.monitored_barrier(timeout=timedelta(seconds=args.timeout / 2), wait_all_ranks=True)
    else:
        dist.barrier()


def train(args: argparse.Namespace, rank: int) -> tuple[int, float]:
    step, samples = 0, torch.zeros(1)
    for step in range(1, args.steps + 1):
        if args.watchdog:  # re-armed every step: only a step that outlasts it dumps the stacks
            faulthandler.dump_traceback_later(args.watchdog, repeat=True)
        gradient = torch.full((9 if args.bug == "shape" and rank == 1 else 8,), float(rank + 1))
        started = time.perf_counter()
        dist.all_reduce(gradient)
        count_dtype = torch.int64 if args.bug == "dtype" and rank == 1 else torch.float64
        samples = torch.tensor([args.per_rank_batch], dtype=count_dtype)
        dist.all_reduce(samples)
        microseconds = (time.perf_counter() - started) * 1e6  # the step's two all-reduces
        print(f"step {step}: gradient[0] {gradient[0].item():g}, samples {samples.item():g}", flush=True)
        report(step=step, gradient=gradient[0].item(), samples=samples.item(), microseconds=microseconds)
        if step % args.checkpoint_every == 0:
            if args.bug == "skip-barrier" and rank != 0 and step == args.checkpoint_every:
                continue  # the planted bug: only rank 0 reaches this barrier
            meet(args)
    faulthandler.cancel_dump_traceback_later()
    return step, samples.item()


def flight_record() -> bytes:
    """This rank's Flight Recorder, in torch's pickle format. `_dump_fr_trace` is the recorder of CPU (gloo)
    collectives; NCCL's is `_dump_nccl_trace`."""
    from torch._C._distributed_c10d import _dump_fr_trace

    return _dump_fr_trace()


def write_flight_record(folder: str, rank: int, data: bytes) -> None:
    """Write one dump to folder/rank<N>, atomically."""
    os.makedirs(folder, exist_ok=True)
    path, temporary = os.path.join(folder, f"rank{rank}"), os.path.join(folder, f".rank{rank}.tmp")
    with open(temporary, "wb") as file:
        file.write(data)
    os.replace(temporary, path)


class KeepDumping:
    """Dump every `seconds` from a background thread: the rank whose collective fails second can be stopped by
    the agent before its own error arrives, and gloo dumps nothing by itself. The main thread, blocked in a
    collective, has released the GIL, so this thread runs meanwhile.

    A collective that fails is retired by gloo's worker thread right after it ends the work (which wakes the
    Python thread), so a dump can land after the retire and before Python has caught the error: it then shows the
    failure, not the hang (lesson 08's during-the-hang check failed that way). So on an error `stop_before` waits
    for the thread and writes back, as rank<N>, the last dump taken at least `margin` seconds before the error was
    caught: chosen by time, not by what the dump holds. If no dump is that old (an error in the first half
    second), rank<N> stays the newest one."""

    def __init__(self, folder: str, rank: int, seconds: float = 0.25, margin: float = 0.5):
        self.folder, self.rank, self.seconds, self.margin = folder, rank, seconds, margin
        self.taken: list[tuple[float, bytes]] = []  # (when the dump call returned, the dump), newest last
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.stop.wait(self.seconds):
            data = flight_record()
            self.taken = [*self.taken[-40:], (time.monotonic(), data)]
            write_flight_record(self.folder, self.rank, data)

    def stop_before(self, failed_at: float | None = None) -> None:
        """Stop dumping; with `failed_at` (time.monotonic() when the error was caught), keep the last dump taken
        at least `margin` seconds before it as rank<N>."""
        self.stop.set()
        self.thread.join()
        if failed_at is not None:
            before = [data for taken_at, data in self.taken if taken_at <= failed_at - self.margin]
            if before:
                write_flight_record(self.folder, self.rank, before[-1])


def allow_any_tracer() -> None:
    """Let any process of the same user ptrace this one (py-spy dump), through Linux's
    prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY). It matters only under Yama's ptrace_scope=1 (Ubuntu's default),
    where a user may otherwise trace only its own descendants; it does not help under ptrace_scope 2 or 3, nor
    in a container that forbids ptrace. Elsewhere (not Linux, no Yama) the call fails and nothing changes."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_ptracer, pr_set_ptracer_any = 0x59616D61, ctypes.c_ulong(2**64 - 1)  # linux/prctl.h: "Yama", -1UL
        libc.prctl(pr_set_ptracer, pr_set_ptracer_any, ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass


@record  # a failure's traceback goes into torchrun's error file, and so into its summary
def main() -> None:
    args = parse_args()
    # torch reads TORCH_DISTRIBUTED_DEBUG once, when torch.distributed is imported; a worker forked from a
    # process that imported it before the variable was set (the notebook's launch server) must read it again
    dist.set_debug_level_from_env()
    if args.stacks_on_signal:  # the two lines to put at the top of any training script
        faulthandler.register(signal.SIGUSR1, all_threads=True)
        allow_any_tracer()  # optional: lets py-spy attach without root where Yama's ptrace_scope is 1
    # gloo on every machine: the planted bugs are gloo cases (monitored_barrier, the SIGABRT on a size mismatch)
    rank, world_size, _ = init_distributed("gloo", timeout=timedelta(seconds=args.timeout))
    if args.flight_recorder:
        dumping = KeepDumping(args.flight_recorder, rank)
    if args.global_batch:
        args.per_rank_batch = args.global_batch // world_size
    try:
        steps, samples = train(args, rank)
    except Exception:
        if args.flight_recorder:  # rank<N> keeps the state during the hang; the last word goes beside it
            dumping.stop_before(failed_at=time.monotonic())
            write_flight_record(os.path.join(args.flight_recorder, "after_error"), rank, flight_record())
        raise
    if args.flight_recorder:
        dumping.stop_before()
        write_flight_record(args.flight_recorder, rank, flight_record())
    result(steps=steps, samples=samples)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
