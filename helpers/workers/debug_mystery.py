"""The mystery job of lesson 08's exercise: after a while every rank's loss is NaN. Where did the NaN start?

    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_mystery.py
    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_mystery.py --nan-check
    torchrun --standalone --nproc-per-node 2 helpers/workers/debug_mystery.py --anomaly

DDP on 2 ranks: a classifier of 16-number "images" that embeds each image in 8 numbers and also looks at the
embedding's length (its L2 norm).
The data are shuffled across ranks by DistributedSampler. Every step prints its loss before backward.
Tools: --nan-check     every step, before backward, which ranks' losses are not finite (stops at the first)
       --anomaly       torch.autograd.set_detect_anomaly(True): the backward op that makes a NaN raises
Settings: --lr LR      the learning rate (default 0.5)
          --model FILE train the `Classifier` defined in FILE instead of the job's own (your fixed copy)
"""
import argparse
import importlib.util
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.debugging import PER_RANK_BATCH, STEPS, WORLD_SIZE, Classifier, images, order
from helpers.kit.distributed import init_distributed
from helpers.kit.instruments import nonfinite_ranks
from helpers.kit.reporting import report, result


def model_class(path: str | None) -> type[nn.Module]:
    """The job's own Classifier, or the one defined in the file at `path`."""
    if path is None:
        return Classifier
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "Classifier"):
        raise AttributeError(f"{Path(path).name} defines no class named Classifier")
    return module.Classifier


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--nan-check", action="store_true")
    parser.add_argument("--anomaly", action="store_true")
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--model", default=None, help="a file that defines Classifier")
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args()
    # gloo on every machine: the model and batches stay on the CPU (nccl serves only CUDA tensors)
    rank, world_size, _ = init_distributed("gloo", timeout=timedelta(seconds=args.timeout))
    assert world_size == WORLD_SIZE, f"the mystery job runs on {WORLD_SIZE} ranks"
    build = model_class(args.model)
    torch.manual_seed(0)
    model = DDP(build())
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    torch.autograd.set_detect_anomaly(args.anomaly)
    x_all, labels_all = images()
    indices = order(rank)
    step, loss, first_nonfinite, losses = 0, torch.zeros(()), None, []
    for step in range(1, STEPS + 1):
        batch = indices[(step - 1) * PER_RANK_BATCH:step * PER_RANK_BATCH]
        loss = nn.functional.cross_entropy(model(x_all[batch]), labels_all[batch])
        print(f"step {step}: loss {loss.item():.4f}", flush=True)
        report(step=step, loss=loss.item())
        losses.append(loss.item())
        if args.nan_check and (bad := nonfinite_ranks(loss)):
            print(f"step {step}: non-finite loss on rank(s) {bad}; stopping before backward", flush=True)
            first_nonfinite = {"step": step, "ranks": bad}
            break
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    result(steps=step, final_loss=loss.item(), losses=losses, first_nonfinite=first_nonfinite,
           model=Path(args.model).name if args.model else None)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
