"""Shared pieces of lesson 05 (RPC): names by rank, RPC start-up from torchrun's environment, data, evaluation.

    from helpers.rpc_ps import start_rpc, worker_name, trainer_batches, accuracy
    rank, world_size = start_rpc()          # rank 0 is "ps", the others "trainer1", "trainer2", ...

Taught in notebooks/05_rpc.ipynb. The functions that peers call remotely live in the worker scripts
themselves (helpers/workers/rpc_*.py): a script runs as ``__main__`` on every rank, so the name
``__main__.ParameterServer`` means the same class everywhere.
"""
from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import torch
import torch.distributed.rpc as rpc
from torch import nn

from helpers.data import load


def worker_name(rank: int) -> str:
    """RPC addresses peers by name: rank 0 is the parameter server, every other rank a trainer."""
    return "ps" if rank == 0 else f"trainer{rank}"


_show_warning = warnings.showwarning


def _without_torchscript_deprecation(message, category, *args, **kwargs) -> None:
    """DistributedOptimizer warns, on every creation, that its TorchScript optimizers are deprecated
    (RPC is in maintenance mode; the lesson says so). Torch forces that warning past the filters
    (simplefilter("always")), so it is dropped here, to keep site-packages paths out of the logs."""
    if "support for functional optimizers is deprecated" not in str(message):
        _show_warning(message, category, *args, **kwargs)


def start_rpc(name: str | None = None, threads: int = 8, timeout: float = 60.0) -> tuple[int, int]:
    """init_rpc with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from torchrun; return (rank, world_size)."""
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # plain `python script.py`: a world of one
    os.environ.setdefault("MASTER_PORT", "29512")
    # init_rpc builds a gloo group internally with an API torch itself has deprecated: not our code.
    warnings.filterwarnings("ignore", message="You are using a Backend")
    warnings.showwarning = _without_torchscript_deprecation
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


def check_counter(script: str) -> str:
    """The exercise's check: launch `script` on 2 processes; say what is right or what is missing."""
    from helpers.launch import launch

    run = launch(script, nproc=2, echo=False, timeout=60)
    got = run.results.get(0, {})
    problems = []
    if got.get("count") != 10:
        problems.append(f"worker0 should report count=10 (ten add(1) calls), got {got.get('count')!r}")
    if got.get("owner") != "worker1":
        problems.append(f"the counter should live on worker1 (its owner), got owner={got.get('owner')!r}")
    if got.get("partial_counts") != list(range(1, 11)):
        problems.append("each add() should return the count after it, so the ten futures give 1..10 "
                        f"in some order; got {got.get('partial_counts')!r}")
    if problems:
        raise AssertionError("Not yet:\n- " + "\n- ".join(problems))
    return ("Correct: the counter lives on worker1, ten remote add() calls ran there (each returned "
            "a distinct count 1..10), and worker0 read the total 10 through the RRef.")
