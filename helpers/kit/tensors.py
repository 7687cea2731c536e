"""Tensors as evidence: exact checksums, flat vectors to compare, byte counts. Worker kit (workers import it).

    from helpers.kit.tensors import parameter_checksum, flat, max_abs_diff, nbytes, held_bytes
    parameter_checksum(model)             # equal on two ranks only if their weights are bitwise equal
    max_abs_diff(run_a, run_b)            # tensors, numbers, state dicts, or lists of them
    held_bytes(model.parameters())        # what this rank holds (a DTensor's local shard only)
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


def nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes the tensors hold (None entries, such as missing gradients, count 0)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes these tensors occupy on this rank (only the local shard of a sharded DTensor)."""
    return sum(_local(tensor).numel() * tensor.element_size() for tensor in tensors)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def checksums(named_tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """One float64 number per tensor: a position-weighted sum, so that swapped elements change it too."""
    values = []
    for tensor in named_tensors.values():
        values_1d = tensor.detach().double().flatten()
        weights = torch.linspace(1.0, 2.0, values_1d.numel(), dtype=torch.float64, device=values_1d.device)
        values.append((values_1d * weights).sum())
    return torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)
