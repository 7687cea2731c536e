"""The data and the model of lesson 08's mystery job (helpers/workers/debug_mystery.py). Worker kit.

Random 16-number "images" of 4 classes, one of them blank, shuffled across 2 ranks by DistributedSampler, and the
classifier the job trains. The exercise's check (helpers.lessons.debugging.check_mystery) reads the same data and
model to know where the NaN starts and what the job's losses are before it.
"""
from __future__ import annotations

import torch
from torch import nn
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


class Classifier(nn.Module):
    """Embeds each image in 8 numbers and also looks at the embedding's length (its L2 norm)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.layer = nn.Linear(16, 8, bias=False), nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        length = torch.sqrt((h ** 2).sum(1, keepdim=True))
        return self.layer(torch.cat([h, length], dim=1))
