"""AMP with DDP: autocast in the forward, GradScaler around backward/step, scaler state in the checkpoint.

    torchrun --standalone --nproc-per-node 2 helpers/workers/amp_ddp.py --save runs/amp_ddp.pt
    torchrun --standalone --nproc-per-node 2 helpers/workers/amp_ddp.py --resume runs/amp_ddp.pt

fp16 on GPUs (nccl) or on CPUs (gloo). DDP all-reduces the *scaled* gradients during backward, so
every rank holds the same gradients before scaler.step() checks them for inf/NaN: an overflow on
one rank (--spike-rank) is an overflow on all, every rank skips the same step, and the scales stay
equal without any extra communication. Works with one process too.
"""
import argparse
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.data import load
from helpers.kit.distributed import init_distributed
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, report, result


def ddp_amp_step(model: DDP, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, x: torch.Tensor,
                 y: torch.Tensor, spike: float) -> dict:
    """One fp16 AMP step of a DDP model; whether it backed off (the scale) and stepped (the weights)."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) * spike
    optimizer.zero_grad(set_to_none=True)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()  # DDP all-reduces the scaled gradients here: an inf on one rank reaches all
    weights_before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)  # every rank sees the same all-reduced gradients, so every rank decides the same
    stepped = any(not torch.equal(before, p) for before, p in zip(weights_before, model.parameters(), strict=True))
    scaler.update()
    return dict(scale=scale, loss=loss.item(), stepped=stepped, backed_off=scaler.get_scale() < scale)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps in total")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--spike-rank", type=int, default=1, help="the rank whose loss spikes once")
    parser.add_argument("--spike-step", type=int, default=8)
    parser.add_argument("--save", help="write model, optimizer and scaler state here at the end")
    parser.add_argument("--resume", help="start from a checkpoint written with --save")
    args = parser.parse_args()

    rank, world_size, device = init_distributed()  # nccl + this rank's GPU, or gloo on the CPU
    if device.type == "cpu":
        torch.set_num_threads(1)  # two ranks share two cores

    torch.manual_seed(0)  # same initial weights on every rank (DDP also broadcasts rank 0's)
    model = DDP(build_model("simple").to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0**12, growth_interval=5)
    first_step = 0
    if args.resume:
        checkpoint = torch.load(args.resume, map_location=device)
        model.module.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        scaler.load_state_dict(checkpoint["scaler"])  # without it the scale restarts from init_scale
        first_step = checkpoint["step"]
    start_scale = scaler.get_scale()
    start_growth_tracker = scaler.state_dict()["_growth_tracker"]  # steps since the last change of scale

    images, labels = load(train=True)[0].tensors
    images, labels = images[rank::world_size], labels[rank::world_size]  # each rank its own shard
    generator = torch.Generator().manual_seed(rank)
    skipped = []
    for step in range(first_step, first_step + args.steps):
        index = torch.randint(len(images), (args.per_rank_batch,), generator=generator)
        spike = 1e6 if step == args.spike_step and rank == args.spike_rank else 1.0  # one bad batch, one rank
        row = ddp_amp_step(model, optimizer, scaler, images[index].to(device), labels[index].to(device), spike)
        if not row["stepped"]:
            skipped.append(step)
        report(step=step, **row)
        progress(step - first_step + 1, total=args.steps)

    if args.save and rank == 0:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(), "step": first_step + args.steps}, args.save)
    weights_checksum = sum(p.double().sum().item() for p in model.parameters())
    print(f"rank {rank}: skipped {skipped}, scale {start_scale:g} -> {scaler.get_scale():g}")
    result(start_scale=start_scale, final_scale=scaler.get_scale(), skipped=skipped, checksum=weights_checksum,
           start_growth_tracker=start_growth_tracker, final_growth_tracker=scaler.state_dict()["_growth_tracker"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
