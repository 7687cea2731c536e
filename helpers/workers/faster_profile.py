"""A DDP step as torch's profiler sees it, exported as a Chrome/Perfetto trace, beside a timeline our own comm hook
records in the same steps.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_profile.py --trace trace.json

Lesson 03's setting (helpers.kit.models.mlp(256, 14), bucket_cap_mb=1, 32 images per rank), twice in one launch:
`plain` (no Python hook, as lesson 03 profiled it) and `hooked` (helpers.kit.faster_step.timeline_hook: torch's
allreduce_hook, with the moments DDP called it and its future completed, in time.perf_counter seconds). After
settling steps (DDP rebuilds its buckets after the first), the two take turns for --profiled steps each inside
one torch.profiler session (CPU activity; torch.profiler.schedule with one warm-up step, as the profiler recipe
does); each step is marked with record_function("<setting> step"). Rank 0 exports the trace from on_trace_ready
with prof.export_chrome_trace (open it in https://ui.perfetto.dev or chrome://tracing) and hands back its path, the hook
timeline of each hooked step (relative to that step's backward call), and the bucket count of each step.
helpers/lessons/faster_step.py reads the trace file. CPU and gloo: on GPUs the CPU-side events are only kernel
launches (see the lesson). Works with one process.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import HookTimeline, release, timeline_hook
from helpers.kit.models import mlp
from helpers.kit.reporting import result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profiled", type=int, default=3, help="steps recorded per setting")
    parser.add_argument("--trace", default=None, help="where rank 0 writes the Chrome trace (default: the run folder)")
    args = parser.parse_args()
    rank, _, device = init_distributed()
    if device.type != "cpu":
        raise SystemExit("faster_profile.py reads CPU-side spans (gloo): on GPUs, profile with ProfilerActivity.CUDA "
                         "and read the kernels on the compute and NCCL streams instead (see the lesson)")
    timeline = HookTimeline()
    models = {"plain": DDP(mlp(256, 14), bucket_cap_mb=1), "hooked": DDP(mlp(256, 14), bucket_cap_mb=1)}
    models["hooked"].register_comm_hook(timeline, timeline_hook)
    images = torch.rand(32, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
    labels = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(rank))
    hook_steps = []

    def step(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        timeline.take()
        started = time.perf_counter()
        loss.backward()
        returned = time.perf_counter()
        if name == "hooked":
            hook_steps.append({"backward_called": started, "backward_returned": returned, "buckets": timeline.take()})

    for _ in range(2):  # settle: DDP rebuilds its buckets after step 0
        step("plain")
        step("hooked")
    hook_steps.clear()
    trace = os.path.abspath(args.trace or os.path.join(os.environ.get("HELPERS_RUN_DIR", "."), "trace_rank0.json"))

    def export(prof: profile) -> None:  # called by the profiler when its active steps are recorded
        if rank == 0:
            prof.export_chrome_trace(trace)

    with profile(activities=[ProfilerActivity.CPU], schedule=schedule(wait=0, warmup=1, active=args.profiled),
                 on_trace_ready=export) as prof:
        for index in range(1 + args.profiled):
            for name in ("plain", "hooked") if index % 2 else ("hooked", "plain"):
                with record_function(f"{name} step"):
                    step(name)
            prof.step()
    if rank == 0:
        result(trace=trace, hook_steps=hook_steps[1:], profiled=args.profiled)  # [0]: the profiler's warm-up step
    release(models)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
