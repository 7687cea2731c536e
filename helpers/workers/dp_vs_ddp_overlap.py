"""Profile one DDP training step: do the all-reduce calls overlap the backward pass?

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_overlap.py --bucket-cap-mb 1

Rank 0 records one step (after two warm-up steps, once DDP has settled its buckets) with
torch.profiler and hands back the backward kernels and the all-reduce calls, with their start and
end in microseconds, for a timeline plot. gloo on CPU, nccl on GPUs; works with one process too.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from helpers.dp import AllreduceCounter, counting_allreduce_hook, deep_mlp
from helpers.worker import result

# c10d's op is the call that hands a bucket to the backend; gloo/nccl events are the transfer itself.
ISSUED, RUNNING = "c10d::allreduce_", ("gloo:all_reduce", "nccl:all_reduce", "ncclDevKernel_AllReduce")


def trace_events(prof: profile) -> list[dict]:
    """Backward ops and all-reduce calls as {name, kind, start_us, end_us}, relative to the first event."""
    events = []
    for event in prof.events():
        name = event.name
        if "Backward" in name and name.startswith("autograd::engine::evaluate_function"):
            kind = "backward"
            name = name.split(": ")[-1]
        elif name == ISSUED:
            kind = "all-reduce issued"
        elif name.startswith(RUNNING):
            kind = "all-reduce running"
        else:
            continue
        events.append({"name": name, "kind": kind, "start_us": event.time_range.start,
                       "end_us": event.time_range.end})
    first = min(e["start_us"] for e in events)
    for e in events:
        e["start_us"], e["end_us"] = e["start_us"] - first, e["end_us"] - first
    return sorted(events, key=lambda e: e["start_us"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket-cap-mb", type=float, default=1.0)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    torch.manual_seed(0)
    model = DDP(deep_mlp().to(device), bucket_cap_mb=args.bucket_cap_mb)
    counter = AllreduceCounter()
    model.register_comm_hook(counter, counting_allreduce_hook)
    images = torch.rand(args.per_rank_batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (args.per_rank_batch,), device=device)

    def step() -> None:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()

    for _ in range(2):
        step()
    counter.reset()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
    with profile(activities=activities) as prof:
        step()
        if use_cuda:
            torch.cuda.synchronize()
    if rank == 0:
        events = trace_events(prof)
        result(events=events, allreduce_calls=counter.calls, bucket_numels=counter.bucket_numels)
        print(f"rank 0 traced {len(events)} events, {counter.calls} all-reduce calls")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
