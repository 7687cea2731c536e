"""What every check in the lessons shares: comparing results, and telling a learner where they stand.

Every exercise check returns a bool and prints one line that starts with "Correct: " or "Not yet: ",
saying exactly what is still wrong. A check must say "Not yet" on the untouched starting code.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def max_abs_diff(first: Any, second: Any) -> float:
    """The largest elementwise difference between two tensors, numbers, state dicts, or lists of them."""
    import torch

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


def correct(message: str) -> bool:
    """Print "Correct: message" and return True."""
    print(f"Correct: {message}")
    return True


def not_yet(message: str) -> bool:
    """Print "Not yet: message" and return False."""
    print(f"Not yet: {message}")
    return False
