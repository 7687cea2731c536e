"""What DistributedSampler hands each rank: shards, padding, drop_last, and why set_epoch matters.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_sampler.py --size 11 --epochs 3

The dataset is just the numbers 0..size-1, so every rank can report exactly which samples it got.
"""
import argparse

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from helpers.kit.reporting import result


def samples_seen(loader: DataLoader) -> list[int]:
    return [int(index) for (batch,) in loader for index in batch]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=11)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    dist.init_process_group("gloo")  # no tensors travel here: the sampler only needs rank and world size
    rank = dist.get_rank()
    dataset = TensorDataset(torch.arange(args.size))

    shards = {}
    for drop_last in (False, True):
        sampler = DistributedSampler(dataset, shuffle=False, drop_last=drop_last)
        shards[f"drop_last={drop_last}"] = samples_seen(DataLoader(dataset, batch_size=4, sampler=sampler))

    epochs = {}
    for call_set_epoch in (False, True):
        sampler = DistributedSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=4, sampler=sampler)
        orders = []
        for epoch in range(args.epochs):
            if call_set_epoch:
                sampler.set_epoch(epoch)  # the shuffle's seed becomes seed + epoch
            orders.append(samples_seen(loader))
        epochs[f"set_epoch={call_set_epoch}"] = orders
    print(f"rank {rank}: {shards}")
    result(shards=shards, epochs=epochs)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
