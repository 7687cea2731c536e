"""Checkpoints that survive a crash: atomic save, safe load, and the RNG state a resume needs.

    from helpers.checkpoint import save_checkpoint, load_checkpoint, rng_state, set_rng_state
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

import contextlib
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from helpers.checks import correct, not_yet


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


class _FailsHalfway:
    """Pickling this raises, after torch.save has already started writing the file."""

    def __reduce__(self):
        raise RuntimeError("simulated crash in the middle of writing a checkpoint")


class _SimulatedCrash(BaseException):
    """Raised by the check in place of a file-system step, as if the process died just before it."""


@contextlib.contextmanager
def _crash_before_file_step(number: int):
    """Make the `number`-th call to os.replace/rename/unlink/remove raise instead of running (pathlib's
    Path.replace, rename and unlink call these); yields a function telling whether that call came."""
    names = ("replace", "rename", "unlink", "remove")
    originals = {name: getattr(os, name) for name in names}
    calls = [0]

    def wrap(name):
        def step(*args, **kwargs):
            calls[0] += 1
            if calls[0] == number:
                raise _SimulatedCrash(f"simulated crash before os.{name}")
            return originals[name](*args, **kwargs)
        return step

    for name in names:
        setattr(os, name, wrap(name))
    try:
        yield lambda: calls[0] >= number
    finally:
        for name, original in originals.items():
            setattr(os, name, original)


def check_atomic_save(save: Callable[[dict, Path], None], folder: str | os.PathLike) -> bool:
    """Lesson 06's exercise: does `save(state, path)` keep the old checkpoint if it dies midway?"""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / "exercise.pt"
    good = {"step": 1, "weight": torch.arange(1000.0)}
    save(good, path)
    try:
        save({"step": 2, "weight": torch.zeros(1000), "oops": _FailsHalfway()}, path)
    except RuntimeError:
        pass
    try:
        after = torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, pickle.UnpicklingError) as error:
        return not_yet(f"the crash destroyed the last good checkpoint ({type(error).__name__}).")
    if after["step"] != 1 or not torch.equal(after["weight"], good["weight"]):
        return not_yet("the file at `path` changed although the second save failed.")
    for crash_at in range(1, 10):  # a crash just before the 1st, 2nd, ... rename/replace/unlink the save does
        save(good, path)
        with _crash_before_file_step(crash_at) as reached:
            try:
                save({"step": 2, "weight": torch.zeros(1000)}, path)
            except _SimulatedCrash:
                pass
        try:
            after = torch.load(path, weights_only=True)
        except (RuntimeError, EOFError, FileNotFoundError, pickle.UnpicklingError) as error:
            return not_yet(f"a crash just before file step {crash_at} of the save (a rename, replace or delete) "
                           f"left no loadable checkpoint ({type(error).__name__}): the old file must stay until "
                           "one rename puts the new one in its place (os.replace, no delete first).")
        if after["step"] == 2 and not reached():
            break  # the save finished before step `crash_at`: every step has been crashed once
    inode = path.stat().st_ino
    save({"step": 3, "weight": good["weight"] * 2}, path)
    if torch.load(path, weights_only=True)["step"] != 3:
        return not_yet("a save that succeeds must replace the checkpoint.")
    if path.stat().st_ino == inode:  # a rename puts a new file (a new inode) in place; a copy rewrites the old one
        return not_yet("the checkpoint file was rewritten in place (a copy, or a second write): a crash during "
                       "that rewrite would still tear it. Write a new file, then rename it over the old one.")
    return correct("a crash in the middle of a save leaves the previous checkpoint intact, "
                   "and a save that succeeds replaces it.")
