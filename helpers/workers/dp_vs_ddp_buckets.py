"""Sweep DDP's bucket_cap_mb: the buckets of the first step and after DDP rebuilds them, calls and time per step.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_buckets.py --caps default 0.5 1 25

For each setting ("default" means no bucket_cap_mb argument at all), wraps the same deep MLP in DDP and
counts the all-reduce calls of every step with a comm hook (one call per bucket). Then it times one DDP model per
setting, without the hook (a Python hook runs once per bucket, inside the backward we time): the settings take turns
in one launch (helpers/kit/timing.py: a shuffled order each round, the same on every rank, after a warm-up round in
which DDP rebuilds its buckets, each turn after a barrier), wall time and CPU time side by side.
Step 1 runs with the buckets DDP built at construction (one for the whole model); at the start of step 2's
forward DDP rebuilds them in the order the first backward produced the gradients (_pre_forward calls
reducer._rebuild_buckets()), so steps 2.. show the buckets training really uses. DDP's logger records the
rebuilt sizes at the start of the following forward, hence at least 3 steps.
Rank 0 hands back one row per setting in results["sweep"]. gloo on CPU, nccl on GPUs; works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import AllreduceCounter, counting_allreduce_hook
from helpers.kit.models import mlp
from helpers.kit.reporting import progress, report, result
from helpers.kit.timing import take_turns

MIB = 2**20


def one_step(model: DDP, optimizer: torch.optim.Optimizer, images: torch.Tensor, labels: torch.Tensor) -> None:
    """One training step (forward, backward with its all-reduces, optimizer step)."""
    optimizer.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
    optimizer.step()
    if images.is_cuda:
        torch.cuda.synchronize()


def sweep_one(cap: float | None, steps: int, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """Train `steps` steps with one bucket setting; return what DDP did in the first and in the later steps."""
    torch.manual_seed(0)
    options = {} if cap is None else {"bucket_cap_mb": cap}
    model = DDP(mlp(256, 14).to(images.device), **options)
    counter = AllreduceCounter()
    model.register_comm_hook(counter, counting_allreduce_hook)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    buckets = []
    for _ in range(steps):
        counter.reset()
        one_step(model, optimizer, images, labels)
        buckets.append([round(n * 4 / MIB, 3) for n in counter.bucket_numels])
    logged = model._get_ddp_logging_data()  # DDP's own record: the rebuilt bucket sizes, in bytes
    return {"setting": "default" if cap is None else f"{cap:g}", "bucket_cap_mb": cap,
            "first_step_buckets_mib": buckets[0], "buckets_mib": buckets[-1],
            "calls_per_step": len(buckets[-1]),
            "same_buckets_every_later_step": all(b == buckets[-1] for b in buckets[1:]),
            "ddp_rebuilt_bucket_bytes": [int(b) for b in str(logged.get("rebuilt_bucket_sizes", "")).split(", ") if b]}


def timed_step(cap: float | None, images: torch.Tensor, labels: torch.Tensor):
    """A function that runs one training step of a DDP model with this cap and no comm hook, as in training."""
    torch.manual_seed(0)
    model = DDP(mlp(256, 14).to(images.device), **({} if cap is None else {"bucket_cap_mb": cap}))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    return lambda: one_step(model, optimizer, images, labels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--caps", nargs="+", default=["default", "0.1", "0.5", "1", "25"],
                        help="bucket_cap_mb values in MiB; 'default' passes none")
    parser.add_argument("--steps", type=int, default=4, help="steps per setting while counting the buckets")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds")
    parser.add_argument("--turn-steps", type=int, default=2, help="timed steps per turn")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be at least 3: step 1 runs before DDP rebuilds its buckets, and DDP logs the "
                     "rebuilt buckets at the start of step 3")

    rank, world_size, device = init_distributed()
    torch.manual_seed(rank)
    images = torch.rand(args.per_rank_batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (args.per_rank_batch,), device=device)

    caps = {text: None if text == "default" else float(text) for text in args.caps}
    total = len(caps) + 1 + args.rounds
    rows = []
    for index, cap in enumerate(caps.values()):
        row = sweep_one(cap, args.steps, images, labels)
        rows.append(row)
        report(step=index, allreduce_calls_per_step=row["calls_per_step"])
        progress(index + 1, total=total)
    turns = [0]

    def barrier() -> None:
        if turns[0] % len(caps) == 0:
            progress(len(caps) + turns[0] // len(caps), total=total)
        turns[0] += 1
        dist.barrier()

    steps = {row["setting"]: timed_step(cap, images, labels) for row, cap in zip(rows, caps.values(), strict=True)}
    timings = take_turns(steps, rounds=args.rounds, warmup=1, repeat=args.turn_steps, between=barrier)
    progress(total, total=total)
    result(timings={name: timing.as_dict() for name, timing in timings.items()})
    parameters = sum(p.numel() for p in mlp(256, 14).parameters())
    if rank == 0:
        result(sweep=rows, parameters=parameters, world_size=world_size, device=device.type,
               per_rank_batch=args.per_rank_batch, first_bucket_bytes_default=dist._DEFAULT_FIRST_BUCKET_BYTES)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
