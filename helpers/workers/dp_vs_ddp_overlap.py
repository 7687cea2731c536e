"""Does DDP's communication overlap the backward pass, and does that shorten the step? Four settings take turns.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_overlap.py --rounds 5

The same deep MLP under DDP four ways, every rank running the same steps (forward and backward):
- "4 buckets": bucket_cap_mb=1, so the first buckets' all-reduces can start while backward goes on;
- "1 bucket": bucket_cap_mb=25, one bucket for the whole model, all-reduced after the last gradient: no overlap;
- "4 buckets, Python all-reduce hook": the first setting with torch's own allreduce_hook, a Python comm hook that
  all-reduces each bucket as DDP's built-in (C++) one does;
- "4 buckets, no all-reduce": the first setting with a Python comm hook that hands each bucket back unchanged.
  Against the Python all-reduce hook it is a control: the same backward, DDP bookkeeping and Python hook machinery,
  nothing sent. (Against the built-in hook it would also leave out what a Python hook costs.)
The settings take turns (helpers/kit/timing.py: a shuffled order each round, the same on every rank, after a warm-up
round, each turn after a barrier), wall time and CPU time side by side. Every backward is also timed by itself: its
wall time, and the CPU time of the training thread in it (time.thread_time: what the thread computed, without the
moments it waited or was descheduled). Then rank 0 profiles --profiled steps of "4 buckets" and of "1 bucket" with
torch.profiler and hands back, per step, the backward ops (wall-clock spans on the training thread), the moments
each bucket's all-reduce was issued (`c10d::allreduce_`) and gloo's all-reduce spans (`gloo:all_reduce`, waiting
included), in microseconds from the start of that step's backward.
CPU and gloo only, and it refuses CUDA: there the backward events on the CPU are only the kernel launches.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from helpers.kit.distributed import init_distributed
from helpers.kit.models import mlp
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns

# c10d's op is the call that hands a bucket to the backend; gloo's event is the transfer itself (with waiting).
ISSUED, RUNNING = "c10d::allreduce_", "gloo:all_reduce"


def no_all_reduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing (a timing control only)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def kind_of(name: str) -> str | None:
    """Which row of the timeline a profiler event belongs to, or None."""
    if name.startswith("autograd::engine::evaluate_function"):
        return "backward"
    if name == ISSUED:
        return "all-reduce issued"
    if name.startswith(RUNNING):
        return "all-reduce running"
    return None


def step_events(prof: profile, step: int) -> list[dict]:
    """The events of profiled step `step` (marked with record_function), times relative to its backward."""
    marks = sorted((e for e in prof.events() if e.name == "profiled step"), key=lambda e: e.time_range.start)
    begin, end = marks[step].time_range.start, marks[step].time_range.end
    events = []
    for event in prof.events():
        kind = kind_of(event.name)
        # a running all-reduce may end after the mark closes (the wait is inside it); keep it by its start
        if kind and begin <= event.time_range.start <= end:
            events.append({"name": event.name.split(": ")[-1], "kind": kind,
                           "start_us": event.time_range.start, "end_us": event.time_range.end})
    first = min(e["start_us"] for e in events if e["kind"] == "backward")
    for e in events:
        e["start_us"], e["end_us"] = e["start_us"] - first, e["end_us"] - first
    return sorted(events, key=lambda e: e["start_us"])


class Setting:
    """One DDP model and its batch; step() runs forward and backward and records the backward's wall and thread CPU
    time."""

    def __init__(self, cap_mb: float, hook, images: torch.Tensor, labels: torch.Tensor) -> None:
        torch.manual_seed(0)
        self.model = DDP(mlp(256, 14), bucket_cap_mb=cap_mb)
        if hook is not None:
            self.model.register_comm_hook(None, hook)
        self.images, self.labels = images, labels
        self.backward_wall: list[float] = []
        self.backward_cpu: list[float] = []

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(self.model(self.images), self.labels)
        wall, cpu = time.perf_counter(), time.thread_time()
        loss.backward()
        self.backward_cpu.append(time.thread_time() - cpu)
        self.backward_wall.append(time.perf_counter() - wall)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first (DDP rebuilds its buckets)")
    parser.add_argument("--turn-steps", type=int, default=3, help="steps per turn")
    parser.add_argument("--profiled", type=int, default=3, help="steps profiled per setting, after the turns")
    args = parser.parse_args()

    rank, _, device = init_distributed()
    if device.type != "cpu":
        raise SystemExit("dp_vs_ddp_overlap.py measures CPU-side spans (gloo): on GPUs, profile the kernels of the "
                         "compute stream against NCCL's kernels instead (see the lesson, section 5)")
    torch.manual_seed(rank)
    torch.set_num_threads(1)
    images = torch.rand(args.per_rank_batch, 1, 28, 28)
    labels = torch.randint(0, 10, (args.per_rank_batch,))
    # DDP's built-in hook on the settings that ask about overlap; the two Python hooks are the communication's control
    settings = {"4 buckets": Setting(1, None, images, labels), "1 bucket": Setting(25, None, images, labels),
                "4 buckets, Python all-reduce hook": Setting(1, allreduce_hook, images, labels),
                "4 buckets, no all-reduce": Setting(1, no_all_reduce, images, labels)}
    turns = [0]

    def barrier() -> None:
        if turns[0] % len(settings) == 0:
            progress(turns[0] // len(settings), args.warmup + args.rounds + 1)
        turns[0] += 1
        dist.barrier()

    timings = take_turns({name: s.step for name, s in settings.items()}, rounds=args.rounds, warmup=args.warmup,
                         repeat=args.turn_steps, between=barrier)
    skip = args.warmup * args.turn_steps  # the warm-up round's backwards (DDP's first, one-bucket step among them)
    backward = {name: {"wall": s.backward_wall[skip:], "cpu": s.backward_cpu[skip:]} for name, s in settings.items()}
    profiled = {}
    for name in ("4 buckets", "1 bucket"):
        setting = settings[name]
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.profiled):
                with record_function("profiled step"):
                    setting.step()
        steps = [step_events(prof, index) for index in range(args.profiled)]
        profiled[name] = {"steps": steps, "backward_wall": setting.backward_wall[-args.profiled:],
                          "backward_cpu": setting.backward_cpu[-args.profiled:],
                          "allreduce_calls": [sum(e["kind"] == "all-reduce issued" for e in ev) for ev in steps]}
    progress(args.warmup + args.rounds + 1, args.warmup + args.rounds + 1)
    result(timings={name: timing.as_dict() for name, timing in timings.items()}, backward=backward)
    if rank == 0:
        result(profiled=profiled, per_rank_batch=args.per_rank_batch, device=device.type)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
