"""Checkpoints that survive a crash: atomic save, safe load, and the RNG state a resume needs.

    from helpers.kit.checkpoint import save_checkpoint, load_checkpoint, rng_state, set_rng_state
    states = [None] * world_size if rank == 0 else None
    dist.gather_object(rng_state(), states, dst=0)   # every rank's generators, not only rank 0's
    if rank == 0:
        save_checkpoint("runs/ckpt.pt", {"model": model.state_dict(), "step": step, "rng": states})
    state = load_checkpoint("runs/ckpt.pt")          # None when there is none yet
    set_rng_state(state["rng"][rank])

Taught in lesson 06 (fault tolerance). The save writes a temporary file next to the target, flushes
it to disk, then renames it over the target: a rename within one folder is atomic, so a crash at any
moment leaves either the old checkpoint or the new one, never half of one (on a POSIX file system; an
object store has no atomic rename: write new keys and a marker last). The load uses
``weights_only=True``, which unpickles tensors and plain containers only, never arbitrary code.
"""
from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import torch


def temporary_path(path: str | os.PathLike) -> Path:
    """Where save_checkpoint writes before the rename (same folder, so the rename is atomic)."""
    path = Path(path)
    return path.with_name(f".{path.name}.tmp")


def save_checkpoint(path: str | os.PathLike, state: dict[str, Any]) -> None:
    """Write `state` to `path` atomically: temporary file, flush to disk, rename over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = temporary_path(path)
    with open(temporary, "wb") as file:
        torch.save(state, file)
        file.flush()
        os.fsync(file.fileno())  # the bytes are on disk before the rename makes them "the" checkpoint
    os.replace(temporary, path)
    _fsync_folder(path.parent)  # and the rename itself survives a power cut


def _fsync_folder(folder: Path) -> None:
    if os.name != "posix":
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu") -> dict | None:
    """The checkpoint at `path` (tensors and plain Python values only), or None if there is none."""
    if not Path(path).exists():
        return None
    return torch.load(path, map_location=map_location, weights_only=True)


def rng_state() -> dict[str, Any]:
    """Every random generator a training loop may draw from, as tensors and plain values."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Put the generators back exactly where rng_state() found them.

    The states go back as CPU tensors: every generator, CUDA's included, takes its state as a CPU ByteTensor
    (check_rng_state in ATen/core/Generator.h), and a checkpoint loaded with map_location="cuda:N" has moved
    them to the GPU ("RNG state must be a torch.ByteTensor" otherwise).
    """
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))  # tuples may come back as lists
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([cuda_state.cpu() for cuda_state in state["cuda"]])
