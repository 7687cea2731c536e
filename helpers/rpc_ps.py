"""Shared pieces of lesson 05 (RPC): names by rank, RPC start-up from torchrun's environment, data, evaluation.

    from helpers.rpc_ps import start_rpc, worker_name, trainer_batches, accuracy, warnings_seen
    rank, world_size = start_rpc()          # rank 0 is "ps", the others "trainer1", "trainer2", ...
    check_counter("my_counter.py")          # the exercise's check: prints "Correct: ..." or "Not yet: ..."

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

from helpers._run_folder import alive as is_alive  # noqa: F401  (lesson 05 imports it from here)
from helpers.data import load


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


SERIAL_SECONDS = 0.6  # ten add() calls one after another take at least 10 x 0.1 s; at once, about 0.1 + 10 x 0.01 s


def check_counter(script: str) -> bool:
    """The exercise's check: launch `script` on 2 processes and say what is right, or what is still wrong."""
    from helpers.checks import correct, not_yet
    from helpers.launch import launch

    got = launch(script, nproc=2, echo=False, timeout=60).results.get(0, {})
    count, owner, partial, seconds = (got.get(key) for key in ("count", "owner", "partial_counts", "seconds"))
    problems = []
    if owner != "worker1":
        problems.append(f"the counter lives on {owner!r}: create it on worker1 with rpc.remote and call it "
                        "through the RRef")
    if seconds is None or seconds > SERIAL_SECONDS:
        problems.append(f"the ten add() calls took more than {SERIAL_SECONDS} s, so they ran one after another: "
                        "send all ten with counter.rpc_async().add(1), then wait for the futures")
    if count != 10 or partial != list(range(1, 11)):
        problems.append(f"the count is {count!r} and the ten add() calls returned {partial!r}, not 1..10: calls "
                        "running at once overwrote each other's update; guard add()'s read and write with a "
                        "threading.Lock")
    if problems:
        return not_yet("; ".join(problems) + ".")
    return correct(f"the counter lives on worker1; ten add() calls ran there at once (in less than "
                   f"{SERIAL_SECONDS} s), and the lock kept every update: they returned 1..10 and the total is 10.")
