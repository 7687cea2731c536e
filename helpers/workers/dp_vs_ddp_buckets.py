"""Sweep DDP's bucket_cap_mb: how many all-reduce calls per step, and how long a step takes.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_buckets.py --caps 0.1 0.5 1 25

For each bucket cap, wraps the same deep MLP in DDP, counts the all-reduce calls with a comm hook
(one call per bucket) and times a few training steps after warm-up. gloo on CPU, nccl on GPUs.
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.dp import AllreduceCounter, counting_allreduce_hook, deep_mlp
from helpers.worker import progress, report, result


def time_steps(model: DDP, images: torch.Tensor, labels: torch.Tensor, steps: int) -> list[float]:
    """Seconds per training step (forward, backward with its all-reduces, optimizer step)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if images.is_cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caps", type=float, nargs="+", default=[0.1, 0.5, 1, 25])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    torch.manual_seed(rank)
    images = torch.rand(args.per_rank_batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (args.per_rank_batch,), device=device)

    for index, cap in enumerate(args.caps):
        torch.manual_seed(0)
        model = DDP(deep_mlp().to(device), bucket_cap_mb=cap)
        counter = AllreduceCounter()
        model.register_comm_hook(counter, counting_allreduce_hook)
        time_steps(model, images, labels, steps=1)  # warm-up: DDP rebuilds its buckets after step 1
        counter.reset()
        seconds = time_steps(model, images, labels, args.steps)
        calls_per_step = counter.calls / args.steps
        median_ms = 1000 * sorted(seconds)[len(seconds) // 2]
        report(step=index, bucket_cap_mb=cap, allreduce_calls_per_step=calls_per_step, step_ms=median_ms)
        if rank == 0:
            mb = [round(n * 4 / 2**20, 2) for n in counter.bucket_numels[: counter.calls // args.steps]]
            result(**{f"cap_{cap:g}": {"calls_per_step": calls_per_step, "bucket_mb": mb, "step_ms": median_ms}})
            print(f"bucket_cap_mb={cap:g}: {calls_per_step:g} all-reduce calls per step, "
                  f"buckets of {mb} MB, {median_ms:.1f} ms per step")
        progress(index + 1, total=len(args.caps))
    parameters = sum(p.numel() for p in model.parameters())
    result(parameters=parameters, world_size=dist.get_world_size(), device=device.type)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
