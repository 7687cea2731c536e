"""DDP steps as torch's profiler records them, exported as a Chrome/Perfetto trace file.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_profile.py --trace trace.json

Lesson 03's setting (helpers.kit.models.mlp(256, 14), 32 images per rank) three ways in one launch: "4 buckets"
(bucket_cap_mb=1, lesson 03's), "1 bucket" (bucket_cap_mb=25: the control, whose one all-reduce can only be issued
after the backward) and "4 buckets, fp16 hook" (torch's fp16_compress_hook from section 1). After settling steps
(DDP rebuilds its buckets after the first), the three take turns for --profiled steps each inside one
torch.profiler session: CPU activity, the shapes and dtypes of each op's inputs (record_shapes), and
torch.profiler.schedule with one warm-up step; each step is marked with record_function("<setting> step"). Rank 0
exports the trace from on_trace_ready with prof.export_chrome_trace (open it in https://ui.perfetto.dev or
chrome://tracing) and hands back its path, and for each profiled step the backward's wall time and the training
thread's CPU time in it (time.thread_time). helpers/lessons/faster_step.py reads the trace file.
CPU and gloo only, and it refuses CUDA: there the backward's CPU-side events are only kernel launches (see the
lesson). Works with one process.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import release
from helpers.kit.models import mlp
from helpers.kit.reporting import result

SETTINGS = {"4 buckets": (1, None), "1 bucket": (25, None),
            "4 buckets, fp16 hook": (1, default_hooks.fp16_compress_hook)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--profiled", type=int, default=3, help="steps recorded per setting")
    parser.add_argument("--trace", default=None, help="where rank 0 writes the Chrome trace (default: the run folder)")
    args = parser.parse_args()
    rank, _, device = init_distributed()
    if device.type != "cpu":
        raise SystemExit("faster_profile.py reads CPU-side spans (gloo): on GPUs, profile with ProfilerActivity.CUDA "
                         "and read the kernels on the compute and NCCL streams instead (see the lesson)")
    torch.set_num_threads(1)
    models = {}
    for name, (cap, hook) in SETTINGS.items():
        torch.manual_seed(0)
        models[name] = DDP(mlp(256, 14), bucket_cap_mb=cap)
        if hook is not None:
            models[name].register_comm_hook(None, hook)
    images = torch.rand(32, 1, 28, 28, generator=torch.Generator().manual_seed(rank))
    labels = torch.randint(0, 10, (32,), generator=torch.Generator().manual_seed(rank))
    backward = {name: {"wall": [], "cpu": []} for name in SETTINGS}

    def step(name: str) -> None:
        model = models[name]
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        wall, cpu = time.perf_counter(), time.thread_time()
        loss.backward()
        backward[name]["cpu"].append(time.thread_time() - cpu)
        backward[name]["wall"].append(time.perf_counter() - wall)

    for _ in range(2):  # settle: DDP rebuilds its buckets after step 0
        for name in SETTINGS:
            step(name)
    trace = os.path.abspath(args.trace or os.path.join(os.environ.get("HELPERS_RUN_DIR", "."), "trace_rank0.json"))

    def export(prof: profile) -> None:  # called by the profiler when its active steps are recorded
        if rank == 0:
            prof.export_chrome_trace(trace)

    order = list(SETTINGS)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True,
                 schedule=schedule(wait=0, warmup=1, active=args.profiled), on_trace_ready=export) as prof:
        for index in range(1 + args.profiled):
            dist.barrier()
            for name in order[index % len(order):] + order[:index % len(order)]:  # each setting first in turn
                with record_function(f"{name} step"):
                    step(name)
            prof.step()
    if rank == 0:
        result(trace=trace, profiled=args.profiled, settings=list(SETTINGS),
               backward={name: {kind: times[-args.profiled:] for kind, times in spans.items()}
                         for name, spans in backward.items()})
    release(models)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
