"""Profile DDP training steps: how much of the all-reduce time runs while backward is computing?

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_overlap.py --bucket-cap-mb 1 --steps 5

After `--steps` - `--profiled` settling steps (DDP rebuilds its buckets after the first), rank 0 records
`--profiled` steps with torch.profiler and hands back, per step, the backward ops (on the training
thread), the moments each bucket's all-reduce was issued (`c10d::allreduce_`, on the training thread) and
the all-reduce running in gloo's own thread (`gloo:all_reduce`), as spans in microseconds from the start of
that step's backward. helpers.lessons.dp_vs_ddp.overlap measures them.
CPU and gloo only, and it refuses CUDA: there the backward events on the CPU are only the launches, running
ahead of the GPU, so "compute" would have to be the compute stream's kernels, which this worker does not read.
Works with one process too.
"""
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function

from helpers.kit.distributed import init_distributed
from helpers.kit.models import mlp
from helpers.kit.reporting import result

# c10d's op is the call that hands a bucket to the backend; gloo's event is the transfer itself (with waiting).
ISSUED, RUNNING = "c10d::allreduce_", "gloo:all_reduce"


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
            events.append({"name": event.name.split(": ")[-1], "kind": kind, "thread": event.thread,
                           "start_us": event.time_range.start, "end_us": event.time_range.end})
    first = min(e["start_us"] for e in events if e["kind"] == "backward")
    for e in events:
        e["start_us"], e["end_us"] = e["start_us"] - first, e["end_us"] - first
    return sorted(events, key=lambda e: e["start_us"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5, help="total steps; the last --profiled are recorded")
    parser.add_argument("--profiled", type=int, default=3)
    args = parser.parse_args()
    if args.steps <= args.profiled:
        parser.error("--steps must exceed --profiled: DDP rebuilds its buckets after the first step")

    rank, _, device = init_distributed()
    if device.type != "cpu":
        raise SystemExit("dp_vs_ddp_overlap.py measures CPU-side spans (gloo): on GPUs, profile the kernels of the "
                         "compute stream against NCCL's kernels instead (see the lesson, section 6)")
    torch.manual_seed(0)
    # No Python comm hook here: it would add Python work (and the GIL) inside the backward we measure.
    model = DDP(mlp(256, 14).to(device), bucket_cap_mb=args.bucket_cap_mb)
    images = torch.rand(args.per_rank_batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (args.per_rank_batch,), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()

    for _ in range(args.steps - args.profiled):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.profiled):
            with record_function("profiled step"):
                step()
    if rank == 0:
        steps = [step_events(prof, index) for index in range(args.profiled)]
        calls = [sum(e["kind"] == "all-reduce issued" for e in events) for events in steps]
        result(steps=steps, allreduce_calls=calls, bucket_cap_mb=args.bucket_cap_mb,
               per_rank_batch=args.per_rank_batch, device=device.type)
        print(f"rank 0 profiled {args.profiled} steps, {calls} all-reduce calls")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
