"""Library code for lesson 02 (DistributedDataParallel), used by its workers and its notebook.

    from helpers.ddp import parameter_checksum, single_process_reference, max_abs_diff
    from helpers.ddp import undefined_names, run_article, check_ddp_worker

Taught in notebooks/02_ddp.ipynb: checksums prove the ranks hold identical weights, the single-
process reference proves DDP's averaged gradients equal one big batch's, and the article helpers
run the source article's tutorial with some of its bugs fixed to show where it breaks.
"""
from __future__ import annotations

import ast
import builtins
import hashlib
import re
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

WORKERS = Path(__file__).resolve().parent / "workers"


def parameter_checksum(model: nn.Module) -> str:
    """A short hash of every parameter's exact bytes: equal only if the weights are bitwise equal."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:12]


def flat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """All tensors as one 1-D float64 vector (for comparing runs)."""
    return torch.cat([t.detach().cpu().reshape(-1).double() for t in tensors])


def max_abs_diff(a: object, b: object) -> float:
    """Largest absolute difference between two equally long sequences of numbers."""
    return (torch.as_tensor(a, dtype=torch.float64) - torch.as_tensor(b, dtype=torch.float64)).abs().max().item()
