"""Tensors as evidence: exact checksums, flat vectors to compare, byte counts. Worker kit (workers import it).

    from helpers.kit.tensors import parameter_checksum, flat, max_abs_diff, own_bytes, storage_bytes
    parameter_checksum(model)             # equal on two ranks only if their weights are bitwise equal
    max_abs_diff(run_a, run_b)            # tensors, numbers, state dicts, or lists of them
    own_bytes(model.parameters())         # each tensor's own elements (a DTensor's local shard), views included
    storage_bytes(model.parameters())     # the memory behind them, each storage once (0 once freed)
    local_shard(tensor)                   # what this rank stores of a DTensor, or the tensor itself
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn


def tensor_checksum(tensors: list[torch.Tensor]) -> str:
    """A short hash of the tensors' exact bytes: equal only if they are bitwise equal."""
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def parameter_checksum(model: nn.Module) -> str:
    """A short hash of every parameter's exact bytes: equal only if the weights are bitwise equal."""
    return tensor_checksum(list(model.parameters()))


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All tensors as one 1-D float64 vector (for comparing runs)."""
    return torch.cat([t.detach().cpu().reshape(-1).double() for t in tensors])


def max_abs_diff(first: Any, second: Any) -> float:
    """The largest elementwise difference between two tensors, numbers, state dicts, or lists of them."""
    if isinstance(first, Mapping):
        if set(first) != set(second):
            raise ValueError(f"different keys: {sorted(set(first) ^ set(second))}")
        return max((max_abs_diff(first[k], second[k]) for k in first), default=0.0)
    if isinstance(first, (list, tuple)) and first and isinstance(first[0], (torch.Tensor, list, tuple, Mapping)):
        if len(first) != len(second):
            raise ValueError(f"different lengths: {len(first)} and {len(second)}")
        return max((max_abs_diff(a, b) for a, b in zip(first, second, strict=True)), default=0.0)
    a = torch.as_tensor(first).detach().cpu().double()
    b = torch.as_tensor(second).detach().cpu().double()
    if a.shape != b.shape:
        raise ValueError(f"different shapes: {tuple(a.shape)} and {tuple(b.shape)}")
    return float((a - b).abs().max()) if a.numel() else 0.0


def local_shard(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores of a tensor: a DTensor's local shard (to_local), or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def own_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of each tensor's own elements on this rank (numel x element size; a DTensor's local shard), added
    up: a view counts its own elements, so two views of one storage count twice. None entries (a missing
    gradient) count 0. What a tensor needs, not what memory holds: for that, storage_bytes."""
    return sum(local_shard(t).numel() * t.element_size() for t in tensors if t is not None)


def storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The bytes of memory behind the tensors on this rank now: each storage counted once, however many tensors
    view it (a DTensor counts its local shard's storage).

    A freed storage (resized to 0) counts 0. FSDP2 keeps each shard padded to ceil(rows / N) rows
    (FSDPParam._sharded_param_data in torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so where N does not
    divide the rows this is more than the shard's own_bytes. Under FakeTensorMode a storage reports its size
    though no byte is allocated. None entries count 0."""
    storages = {}
    for tensor in tensors:
        if tensor is not None:
            storage = local_shard(tensor).untyped_storage()
            storages[storage._cdata] = storage.nbytes()  # _cdata: one per storage, shared by all its views
    return sum(storages.values())


def checksums(named_tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One float64 number per tensor: a position-weighted sum, so that swapped elements change it too."""
    values = []
    for tensor in named_tensors.values():
        values_1d = tensor.detach().double().flatten()
        weights = torch.linspace(1.0, 2.0, values_1d.numel(), dtype=torch.float64, device=values_1d.device)
        values.append((values_1d * weights).sum())
    return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)
