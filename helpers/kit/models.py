"""The models every lesson uses, so that results compare across lessons.

SimpleModel is the source article's model, unchanged: 784 -> 10 -> 10 -> 10 with ReLUs.
SmallCNN is the option for when accuracy should look like MNIST's usual numbers.
mlp(width, hidden_layers) is lesson 07's model: a Sequential of Linear and ReLU layers, easy to cut into
pipeline stages and to shard layer by layer.
"""
from __future__ import annotations

from itertools import pairwise

import torch
from torch import nn


class SimpleModel(nn.Module):
    """The article's model (8,070 parameters)."""

    def __init__(self) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(28 * 28, 10)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(10, 10)
        self.fc3 = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(self.flatten(x)))
        x = self.relu(self.fc2(x))
        return self.fc3(x)


class SmallCNN(nn.Module):
    """Two conv layers and a classifier (about 20k parameters): still fast on a CPU."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32 * 7 * 7, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def mlp(width: int, hidden_layers: int, seed: int = 0) -> nn.Sequential:
    """784 -> width -> (width -> width) x hidden_layers -> 10, ReLUs between (lesson 07)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU()]
    for _ in range(hidden_layers):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def build_model(name: str = "simple") -> nn.Module:
    """'simple' (the article's) or 'cnn'."""
    models = {"simple": SimpleModel, "cnn": SmallCNN}
    if name not in models:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(models)}")
    return models[name]()


def split_stages(model: nn.Sequential, parts: int) -> list[nn.Sequential]:
    """Cut a Sequential into `parts` consecutive stages holding about equal numbers of parameters."""
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    total, bounds, running = sum(sizes), [0], 0
    for index, size in enumerate(sizes):
        running += size
        if len(bounds) < parts and running >= total * len(bounds) / parts:
            bounds.append(index + 1)
    bounds.append(len(model))
    return [model[start:end] for start, end in pairwise(bounds)]
