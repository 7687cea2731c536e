"""Exercise solution, the second way: ddp_exercise_single.py made data-parallel by hand, without DDP.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_exercise_by_hand_solution.py

What DDP does for this model, written out: start every rank from rank 0's weights, and after each
backward() average every gradient over the ranks (all_reduce sums, then divide by world_size).
DDP does the same in gradient buckets, overlapped with the backward pass (lesson 03).
"""
import os

import torch
import torch.distributed as dist
from torch import nn
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
    for parameter in model.parameters():  # what DDP's constructor does: everyone starts from rank 0's weights
        dist.broadcast(parameter.data, src=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples_seen = 0
    for images, labels in loader:
        loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()
        for parameter in model.parameters():  # what DDP does during backward: average the gradients
            dist.all_reduce(parameter.grad)  # the sum over the ranks ...
            parameter.grad /= world_size  # ... divided: the mean of the per-rank means, one big batch's
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
