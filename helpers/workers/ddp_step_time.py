"""Time a training step in one launch: DDP on 2 ranks against 1 process, with the controls that split the difference.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_step_time.py --rounds 7

A step is forward, backward (with DDP: the gradient all-reduce) and the optimizer step, on a batch already in
memory: no data loading, no start-up, no evaluation; always --global-batch samples in all, split over the ranks
under DDP. The settings, for each model:
- "DDP, 2 ranks": every rank, one thread each, its share of the global batch, DDP's built-in (C++) all-reduce;
- "DDP, Python all-reduce hook": the same with torch's own allreduce_hook, a Python comm hook that all-reduces
  each gradient bucket as the built-in one does;
- "DDP, no all-reduce": the same with a Python comm hook that hands each bucket back unchanged (nothing is sent;
  each rank steps with its own gradients). Its difference from the Python all-reduce hook is what the all-reduce
  costs, with the same Python hook machinery on both sides;
- "all-reduce alone": every rank all-reduces as many floats as the model has gradients, with no training around it;
- "1 rank, batch 32": rank 0 alone, one thread, the per-rank batch: what each DDP rank computes;
- "1 rank, 1 thread" and "1 rank, 2 threads": rank 0 alone with the whole global batch.
The settings take turns in one launch (helpers/kit/timing.py: a shuffled order each round, the same on every rank,
after warm-up rounds), every turn timing --block-steps steps, wall time and CPU time side by side. Every turn starts
at a barrier; while rank 0 runs alone, the other ranks wait in that barrier and record the CPU time they used
meanwhile. Thread counts are set with torch.set_num_threads, not inherited.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns


def no_all_reduce(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP comm hook that communicates nothing: each rank keeps its own gradients (a timing control only)."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def training_step(model: nn.Module, batch: int, threads: int):
    """A function that runs one training step of `model` on a fixed random batch with `threads` intra-op threads."""
    images, labels = torch.rand(batch, 1, 28, 28), torch.randint(0, 10, (batch,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
    return step


def all_reduce_alone(floats: int):
    tensor = torch.zeros(floats)

    def step() -> None:
        if torch.get_num_threads() != 1:
            torch.set_num_threads(1)
        dist.all_reduce(tensor)
    return step


def settings_for(name: str, rank: int, world_size: int, global_batch: int) -> dict:
    """Every setting of one model, as this rank runs it (a rank that sits a setting out does nothing)."""
    def rank_0_only(build):
        return build() if rank == 0 else (lambda: None)

    torch.manual_seed(0)
    quiet = DDP(build_model(name))
    quiet.register_comm_hook(None, no_all_reduce)
    python_hook = DDP(build_model(name))
    python_hook.register_comm_hook(None, allreduce_hook)  # state None: the default process group
    per_rank = global_batch // world_size
    floats = sum(p.numel() for p in build_model(name).parameters())
    return {
        f"{name}, DDP, {world_size} ranks": training_step(DDP(build_model(name)), per_rank, 1),
        f"{name}, DDP, Python all-reduce hook": training_step(python_hook, per_rank, 1),
        f"{name}, DDP, no all-reduce": training_step(quiet, per_rank, 1),
        f"{name}, all-reduce alone": all_reduce_alone(floats),
        f"{name}, 1 rank, batch {per_rank}": rank_0_only(lambda: training_step(build_model(name), per_rank, 1)),
        f"{name}, 1 rank, 1 thread": rank_0_only(lambda: training_step(build_model(name), global_batch, 1)),
        f"{name}, 1 rank, 2 threads": rank_0_only(lambda: training_step(build_model(name), global_batch, 2)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", nargs="+", default=["simple", "cnn"], choices=["simple", "cnn"])
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--block-steps", type=int, default=5, help="timed steps per turn")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    args = parser.parse_args()
    rank, world_size, _ = init_distributed(backend="gloo")  # CPU timing, whatever the machine has
    if world_size < 2:
        raise SystemExit("ddp_step_time.py compares 2 ranks with 1: start it with torchrun --nproc-per-node 2")
    settings = {}
    for name in args.model:
        settings.update(settings_for(name, rank, world_size, args.global_batch))
    waited = {"wall_seconds": 0.0, "cpu_seconds": 0.0}
    turns = [0]

    total_turns = (args.warmup + args.rounds) * len(settings)

    def barrier() -> None:  # every turn starts on every rank at once; the other ranks wait here while rank 0 runs
        progress(turns[0], total_turns)
        turns[0] += 1
        wall, cpu = time.perf_counter(), time.process_time()
        dist.barrier()
        if rank != 0:
            waited["wall_seconds"] += time.perf_counter() - wall
            waited["cpu_seconds"] += time.process_time() - cpu

    timings = take_turns(settings, rounds=args.rounds, warmup=args.warmup, repeat=args.block_steps, between=barrier)
    dist.barrier()
    progress(total_turns, total_turns)
    result(timings={name: timing.as_dict() for name, timing in timings.items()}, waited=waited,
           world_size=world_size, parameters={name: sum(p.numel() for p in build_model(name).parameters())
                                              for name in args.model})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
