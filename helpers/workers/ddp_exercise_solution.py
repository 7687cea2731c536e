"""Exercise solution: ddp_exercise_single.py as a DDP worker.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_exercise_solution.py
"""
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import result
from helpers.kit.tensors import flat

GLOBAL_BATCH = 32


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")

    train_set, _ = load(train=True, limit=256)
    sampler = DistributedSampler(train_set, shuffle=False)  # each rank gets its own share
    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH // world_size, sampler=sampler)

    torch.manual_seed(0)
    model = build_model("simple").to(device)
    ddp_model = DDP(model)  # averages gradients over the ranks during backward
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    samples_seen = 0
    for images, labels in loader:
        loss = nn.functional.cross_entropy(ddp_model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        samples_seen += len(labels)
    if rank == 0:
        print(f"trained on {samples_seen} samples per rank, last loss {loss.item():.3f}")
    # the weights, and each parameter's .grad after the last step: the check compares both across the ranks
    result(weights=flat(list(model.parameters())), gradients=[p.grad for p in model.parameters()],
           samples_seen=samples_seen)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
