"""Time a training step in one launch: DDP with and without its all-reduce, 1 rank on 1 or 2 threads, and controls.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_step_time.py --threads 1 2

A step is forward, backward (with DDP: the gradient all-reduce) and the optimizer step, on a batch
already in memory: no data loading, no start-up, no evaluation; always --global-batch samples, split
over the ranks under DDP. The control "no all-reduce" is DDP with a comm hook that returns each gradient
bucket unchanged (DistributedDataParallel.register_comm_hook): the same processes, the same DDP
bookkeeping, no communication, so its difference from DDP is what the all-reduce costs. Thread counts
are set with torch.set_num_threads, not inherited. Each block times --block-steps steps after --warmup
untimed ones, and the settings take turns block by block (--repeats rounds), so that a busy moment on
the machine hits every setting alike. While rank 0 runs alone the other ranks wait in dist.barrier(),
and report how much CPU time they used meanwhile.
Two controls: rank 0 alone at the per-rank batch (global batch / world size, 1 thread), which is
what each DDP rank computes, so "2 ranks halved the work for free" is measured, not assumed; and a
bare dist.all_reduce of as many floats as the model has parameters, on all ranks, between two
barriers, with no training around it (what sending the gradients costs when nobody is computing).
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.models import build_model
from helpers.kit.reporting import result


def no_all_reduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: each rank keeps its own gradients (a timing control only)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def block_median(model: nn.Module, batch: int, steps: int, warmup: int) -> float:
    """Median wall time of `steps` training steps on a random batch, after `warmup` untimed ones."""
    images, labels = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
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
    parser.add_argument("--threads", nargs="+", type=int, default=[1, 2], help="for rank 0 alone")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--block-steps", type=int, default=10, help="timed steps per block")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rank, world_size, _ = init_distributed(backend="gloo")  # CPU timing, whatever the machine has
    torch.manual_seed(rank)
    blocks: dict[str, list[float]] = {}
    waited = {"wall_seconds": 0.0, "cpu_seconds": 0.0}
    for _ in range(args.repeats):
        for name in args.model:
            torch.manual_seed(0)
            if world_size > 1:  # every rank: DDP, one thread each, with and without the all-reduce
                torch.set_num_threads(1)
                for hook, label in ((None, ""), (no_all_reduce, ", no all-reduce")):
                    model = DDP(build_model(name))
                    if hook is not None:
                        model.register_comm_hook(None, hook)
                    dist.barrier()  # both ranks start the block together ...
                    seconds = block_median(model, args.global_batch // world_size, args.block_steps, args.warmup)
                    dist.barrier()  # ... and neither goes on while the other still trains (no hook: no meeting)
                    blocks.setdefault(f"{name}, {world_size} rank(s) x {torch.get_num_threads()} thread(s){label}",
                                     []).append(seconds)
            if world_size > 1:  # the gradients' all-reduce alone, no training around it
                torch.set_num_threads(1)
                floats = torch.zeros(sum(p.numel() for p in build_model(name).parameters()))
                dist.barrier()
                times = []
                for step in range(args.warmup + args.block_steps):
                    started = time.perf_counter()
                    dist.all_reduce(floats)
                    if step >= args.warmup:
                        times.append(time.perf_counter() - started)
                dist.barrier()
                blocks.setdefault(f"{name}, all_reduce alone, {floats.numel()} floats", []).append(
                    statistics.median(times))
                if rank == 0:  # rank 0 alone at the per-rank batch: what each DDP rank computes
                    seconds = block_median(build_model(name), args.global_batch // world_size, args.block_steps,
                                           args.warmup)
                    blocks.setdefault(f"{name}, 1 rank(s) x 1 thread(s), batch {args.global_batch // world_size}",
                                      []).append(seconds)
                dist.barrier()
            for threads in args.threads:  # rank 0 alone, the whole global batch
                if rank == 0:
                    torch.set_num_threads(threads)
                    seconds = block_median(build_model(name), args.global_batch, args.block_steps, args.warmup)
                    blocks.setdefault(f"{name}, 1 rank(s) x {torch.get_num_threads()} thread(s)", []).append(seconds)
                wall, cpu = time.perf_counter(), time.process_time()
                dist.barrier()
                if rank != 0:
                    waited["wall_seconds"] += time.perf_counter() - wall
                    waited["cpu_seconds"] += time.process_time() - cpu
    result(blocks=blocks, waited=waited, world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
