"""Time one training step: 1 rank on 1 or 2 threads, or N ranks with DDP, at the same global batch.

    python helpers/workers/ddp_step_time.py --threads 1 2                                  # one process
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_step_time.py --threads 1  # DDP, 2 ranks

A step is forward, backward (with DDP: the gradient all-reduce) and the optimizer step, on a batch
already in memory: no data loading, no start-up, no evaluation. The thread count is set with
torch.set_num_threads, not inherited. Each block times --block-steps steps after --warmup untimed ones;
the blocks cycle through models and thread counts --repeats times, so that a busy moment on the
machine hits every setting alike. Reports every block's median step time, in seconds.
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.distributed import init_distributed
from helpers.models import build_model
from helpers.worker import result


def block_median(model: nn.Module, optimizer: torch.optim.Optimizer, images: torch.Tensor,
                 labels: torch.Tensor, steps: int, warmup: int) -> float:
    """Median wall time of `steps` training steps, after `warmup` untimed ones."""
    times = []
    for step in range(warmup + steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if step >= warmup:
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["simple", "cnn"], choices=["simple", "cnn"])
    parser.add_argument("--threads", nargs="+", type=int, default=[1])
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--block-steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    per_rank_batch = args.global_batch // world_size
    torch.manual_seed(rank)
    images, labels = torch.rand(per_rank_batch, 1, 28, 28, device=device), torch.randint(0, 10, (per_rank_batch,))
    labels = labels.to(device)

    blocks = {}
    for _ in range(args.repeats):
        for name in args.model:
            torch.manual_seed(0)
            model = build_model(name).to(device)
            if world_size > 1:
                model = DDP(model)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for threads in args.threads:
                torch.set_num_threads(threads)
                label = f"{name}, {world_size} rank(s) x {torch.get_num_threads()} thread(s)"
                blocks.setdefault(label, []).append(block_median(model, optimizer, images, labels,
                                                                 args.block_steps, args.warmup))
    result(blocks=blocks, per_rank_batch=per_rank_batch, world_size=world_size, device=device.type)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
