"""Lesson 05's shared worker pieces (RPC): names by rank, RPC start-up from torchrun's environment, data. Worker kit.

    from helpers.kit.rpc import accuracy, start_rpc, trainer_batches, warnings_seen, worker_name
    rank, world_size = start_rpc()          # rank 0 is "ps", the others "trainer1", "trainer2", ...

Taught in notebooks/05_rpc.ipynb. The functions that peers call remotely live in the worker scripts
themselves (helpers/workers/rpc_*.py): a script runs as ``__main__`` on every rank, so the name
``__main__.ParameterServer`` means the same class everywhere. The exercise's check is in helpers/lessons/rpc.py.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed.rpc as rpc
from torch import nn

from helpers.kit.data import load


def worker_name(rank: int) -> str:
    """RPC addresses peers by name: rank 0 is the parameter server, every other rank a trainer."""
    return "ps" if rank == 0 else f"trainer{rank}"


_warnings_seen: list[str] = []


def _short_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """Print each distinct warning once, as "Category: message" without the site-packages path, and keep it.

    DistributedOptimizer's remote optimizers warn on every creation that TorchScript functional optimizers
    are deprecated (torch/distributed/optim/_deprecation_warning.py forces it past the filters with
    simplefilter("always")); the lesson prints what each run collected with warnings_seen()."""
    text = f"{category.__name__}: {message}"
    if text not in _warnings_seen:
        _warnings_seen.append(text)
        print(text, flush=True)


def warnings_seen() -> list[str]:
    """The distinct warnings this process has printed since start_rpc."""
    return list(_warnings_seen)


def start_rpc(name: str | None = None, threads: int = 8, timeout: float = 60.0) -> tuple[int, int]:
    """init_rpc with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun; return (rank, world_size).

    `timeout` is the RPC timeout: the longest a single rpc_sync/rpc_async/remote call may take."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain `python script.py`: a world of one
    os.environ.setdefault("MASTER_PORT", "29512")
    # init_rpc builds a gloo group internally with an API torch itself has deprecated: not our code.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.showwarning = _short_warning
    options = rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=timeout)
    rpc.init_rpc(name or worker_name(rank), rank=rank, world_size=world_size, rpc_backend_options=options)
    return rank, world_size


def trainer_batches(trainer: int, trainers: int, batch_size: int, steps: int,
                    limit: int | None = 4096) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """`steps` batches from this trainer's shard (every trainers-th sample), cycling through it."""
    train_set, _ = load(train=True, limit=limit)
    images, labels = train_set.tensors
    images, labels = images[trainer::trainers], labels[trainer::trainers]
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(trainer))
    for step in range(steps):
        start = (step * batch_size) % len(labels)
        chosen = order[start:start + batch_size]
        yield images[chosen], labels[chosen]


@torch.no_grad()
def accuracy(model: nn.Module, limit: int | None = 2000) -> float:
    """Fraction of the test set the model classifies correctly."""
    test_set, _ = load(train=False, limit=limit)
    images, labels = test_set.tensors
    return (model(images).argmax(dim=1) == labels).float().mean().item()


