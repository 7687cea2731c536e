"""Lesson 06's exercise check: does a learner's save keep the old checkpoint when it dies midway?

    from helpers.lessons.checkpoint import check_atomic_save
    check_atomic_save(my_save, "runs/exercise")      # "Correct: ..." or "Not yet: ..." and why

The worker-side functions it checks against (save_checkpoint, load_checkpoint, the RNG state) are in
helpers/kit/checkpoint.py.
"""
from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable
from pathlib import Path

import torch

from helpers.lessons.checks import correct, not_yet


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


@contextlib.contextmanager
def _renames_recorded():
    """Record the (source, destination) of every os.replace/os.rename while it is open (shutil.move and pathlib
    call these too); the calls still run."""
    originals = {name: getattr(os, name) for name in ("replace", "rename")}
    seen: list[tuple[str, str]] = []

    def wrap(original):
        def step(src, dst, *args, **kwargs):
            seen.append((os.fspath(src), os.fspath(dst)))
            return original(src, dst, *args, **kwargs)
        return step

    for name, original in originals.items():
        setattr(os, name, wrap(original))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(os, name, original)


def check_atomic_save(save: Callable[[dict, Path], None], folder: str | os.PathLike) -> bool:
    """Lesson 06's exercise: does `save(state, path)` keep the old checkpoint if it dies midway?"""
    Path(folder).mkdir(parents=True, exist_ok=True)
    path = Path(folder) / "exercise.pt"
    path.unlink(missing_ok=True)  # a file left by an earlier try must not stand in for this try's save
    good = {"step": 1, "weight": torch.arange(1000.0)}
    save(good, path)
    if not path.exists():
        return not_yet("nothing is at `path` after a successful save: rename the temporary file into place.")
    try:
        save({"step": 2, "weight": torch.zeros(1000), "oops": _FailsHalfway()}, path)
    except RuntimeError:
        pass
    try:
        after = torch.load(path, weights_only=True)
    except (RuntimeError, EOFError, FileNotFoundError, pickle.UnpicklingError) as error:
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
    with _renames_recorded() as renames:
        save({"step": 3, "weight": good["weight"] * 2}, path)
    if torch.load(path, weights_only=True)["step"] != 3:
        return not_yet("a save that succeeds must replace the checkpoint.")
    if path.stat().st_ino == inode:  # a rename puts a new file (a new inode) in place; a copy rewrites the old one
        return not_yet("the checkpoint file was rewritten in place (a copy, or a second write): a crash during "
                       "that rewrite would still tear it. Write a new file, then rename it over the old one.")
    target = path.resolve()
    elsewhere = [Path(src).resolve().parent for src, dst in renames
                 if Path(dst).resolve() == target and Path(src).resolve().parent != target.parent]
    if elsewhere:
        return not_yet(f"the new file was written in {elsewhere[0]}, not beside the checkpoint, and then moved: a "
                       "rename is atomic only within one file system. On a cluster the checkpoints sit on shared "
                       "storage, a temporary folder like /tmp on the node's own disk: os.replace across them fails "
                       "(EXDEV) and shutil.move falls back to a copy, which a crash can tear. Create the temporary "
                       "file in the checkpoint's own folder (tempfile.mkstemp(dir=path.parent)).")
    return correct("a crash in the middle of a save leaves the previous checkpoint intact, "
                   "and a save that succeeds replaces it.")
