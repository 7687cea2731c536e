"""DataParallel (threads in one process) against DDP (processes), same global batch, same total threads.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_speed.py --mode ddp --global-batch 256
    python helpers/workers/dp_vs_ddp_speed.py --mode dp --devices 2 --global-batch 256
    python helpers/workers/dp_vs_ddp_speed.py --mode single --threads 2 --global-batch 256

Every mode trains the same wide MLP (matrix multiplies dominate) for `--steps` steps on the same
batches and times the steps after the first two:
- ddp: one process per rank, one intra-op thread each, DistributedDataParallel, global-batch / world size per rank;
- dp: one process; on CPU our rebuild, helpers.kit.dp_vs_ddp.NaiveDataParallel, with `--devices` threads and one
  intra-op thread (so as many threads compute as DDP has processes), and its median time per phase;
  with 2+ GPUs, the real nn.DataParallel;
- single: one process, no wrapper, `--threads` intra-op threads: what the same cores do without any DP.
Each mode hands back its median step time and a checksum of the trained weights, which must agree.
"""
import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.dp_vs_ddp import NaiveDataParallel
from helpers.kit.models import mlp
from helpers.kit.reporting import result


def batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.rand(global_batch, 1, 28, 28, generator=generator),
             torch.randint(0, 10, (global_batch,), generator=generator)) for _ in range(steps)]


def train(step, data: list, device: torch.device) -> list[float]:
    """Run step(images, labels) on every batch; return the seconds of each."""
    seconds = []
    for images, labels in data:
        start = time.perf_counter()
        step(images.to(device), labels.to(device))
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["ddp", "dp", "single"], required=True)
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="total steps; the first two are not timed")
    parser.add_argument("--devices", type=int, default=2, help="dp on CPU: how many device threads")
    parser.add_argument("--threads", type=int, default=2, help="single: intra-op threads")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    rank, world_size, device = init_distributed() if args.mode == "ddp" else (0, 1, torch.device("cpu"))
    gpus = torch.cuda.device_count()
    if args.mode == "dp" and gpus >= 2:
        device = torch.device("cuda:0")
    torch.set_num_threads(args.threads if args.mode == "single" else 1)
    torch.manual_seed(0)
    model = mlp(args.width, args.depth - 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = nn.functional.cross_entropy
    data = batches(args.steps, args.global_batch)

    if args.mode == "ddp":
        wrapped = DDP(model)
        per_rank = args.global_batch // world_size
        data = [(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]) for x, y in data]
    elif args.mode == "dp" and gpus >= 2:
        wrapped = nn.DataParallel(model)
    elif args.mode == "dp":
        naive = NaiveDataParallel(model, args.devices, evidence=False)
    else:
        wrapped = model

    phases: list[dict[str, float]] = []

    def step(images: torch.Tensor, labels: torch.Tensor) -> None:
        optimizer.zero_grad(set_to_none=True)
        if args.mode == "dp" and gpus < 2:
            phases.append(naive.train_step(images, labels, loss_fn, optimizer).phase_seconds)
            return
        loss_fn(wrapped(images), labels).backward()
        optimizer.step()

    seconds = train(step, data, device)
    timed = sorted(seconds[2:])
    weights = torch.cat([p.detach().flatten().double().cpu() for p in model.parameters()])
    if rank == 0:
        what = {"ddp": f"DDP, {world_size} processes x 1 thread", "single": f"1 process x {args.threads} threads",
                "dp": (f"nn.DataParallel on {gpus} GPUs" if gpus >= 2 else
                       f"our CPU DataParallel, 1 process x {args.devices} device threads")}[args.mode]
        phase_ms = {name: 1000 * sorted(p[name] for p in phases[2:])[len(phases[2:]) // 2] for name in phases[0]} \
            if phases else {}
        result(mode=args.mode, what=what, step_ms=1000 * timed[len(timed) // 2],
               step_ms_all=[1000 * s for s in seconds], phase_ms=phase_ms,
               checksum=float(weights.sum()), abs_checksum=float(weights.abs().sum()),
               parameters=weights.numel(), global_batch=args.global_batch, steps=args.steps)
        print(f"{what}: {1000 * timed[len(timed) // 2]:.1f} ms per step (median of {len(timed)})")
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
