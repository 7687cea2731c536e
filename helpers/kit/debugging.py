"""The data of lesson 08's mystery job (helpers/workers/debug_mystery.py). Worker kit.

Random 16-number "images" of 4 classes, one of them blank, shuffled across 2 ranks by DistributedSampler.
The exercise's check (helpers.lessons.debugging.check_mystery) reads the same data to know where the NaN starts.
"""
from __future__ import annotations

import torch
from torch.utils.data import DistributedSampler

STEPS, PER_RANK_BATCH, WORLD_SIZE, SHUFFLE_SEED = 10, 8, 2, 8


def images() -> tuple[torch.Tensor, torch.Tensor]:
    """The data set: random images of 16 numbers and 4 classes. One scan failed and came out blank."""
    generator = torch.Generator().manual_seed(3)
    x = torch.rand(STEPS * PER_RANK_BATCH * WORLD_SIZE, 16, generator=generator)
    labels = torch.randint(0, 4, (len(x),), generator=generator)
    x[37] = 0.0
    return x, labels


def order(rank: int) -> list[int]:
    """The sample indices this rank trains on, in order (PER_RANK_BATCH per step)."""
    sampler = DistributedSampler(range(len(images()[0])), num_replicas=WORLD_SIZE, rank=rank, seed=SHUFFLE_SEED)
    return list(sampler)
