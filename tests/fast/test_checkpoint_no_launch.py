"""Lesson 06's checkpoints (helpers.kit.checkpoint) and the atomic-save exercise's check, in this process: no launch."""
from __future__ import annotations

import io
import os
import random

import pytest
import torch

from helpers.kit.checkpoint import (
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
    temporary_path,
)
from helpers.lessons.checkpoint import check_atomic_save


def test_save_then_load_round_trips_and_leaves_no_temporary_file(tmp_path):
    state = {"weight": torch.randn(5), "step": 3, "rng": rng_state()}
    save_checkpoint(tmp_path / "sub" / "ckpt.pt", state)
    loaded = load_checkpoint(tmp_path / "sub" / "ckpt.pt")
    assert torch.equal(loaded["weight"], state["weight"]) and loaded["step"] == 3
    assert not temporary_path(tmp_path / "sub" / "ckpt.pt").exists()
    assert load_checkpoint(tmp_path / "missing.pt") is None


def test_rng_state_restores_every_generator():
    saved = rng_state()
    expected = (torch.rand(3), random.random())
    buffer = io.BytesIO()
    torch.save(saved, buffer)  # through a file, as a resume does
    buffer.seek(0)
    set_rng_state(torch.load(buffer, weights_only=True))
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: map_location='cuda' moves the RNG states")
def test_rng_state_restores_from_a_checkpoint_loaded_onto_the_gpu(tmp_path):
    """The worker loads its checkpoint with map_location=its device; generators take CPU states only."""
    save_checkpoint(tmp_path / "rng.pt", {"rng": rng_state()})
    expected = (torch.rand(3), torch.rand(3, device="cuda"))
    set_rng_state(load_checkpoint(tmp_path / "rng.pt", map_location="cuda")["rng"])
    assert torch.equal(torch.rand(3), expected[0]) and torch.equal(torch.rand(3, device="cuda"), expected[1])


def test_atomic_save_passes_the_exercise_check_and_a_plain_save_does_not(tmp_path):
    assert check_atomic_save(lambda state, path: save_checkpoint(path, state), tmp_path)
    assert not check_atomic_save(lambda state, path: torch.save(state, path), tmp_path / "naive")


def test_atomic_save_check_rejects_a_temporary_file_copied_over_the_checkpoint(tmp_path, capsys):
    import shutil

    def copy_save(state, path):  # survives a crash in torch.save, but the copy itself is not atomic
        temporary = path.with_name(path.name + ".tmp")
        torch.save(state, temporary)
        shutil.copyfile(temporary, path)

    assert not check_atomic_save(copy_save, tmp_path)
    assert "rewritten in place" in capsys.readouterr().out


def test_atomic_save_check_rejects_a_save_that_deletes_the_old_file_before_the_rename(tmp_path, capsys):
    def unlink_then_rename(state, path):  # survives a crash while pickling, not one between unlink and rename
        buffer = io.BytesIO()
        torch.save(state, buffer)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(buffer.getvalue())
        if path.exists():
            path.unlink()
        temporary.rename(path)

    assert not check_atomic_save(unlink_then_rename, tmp_path)
    assert "just before file step 2" in capsys.readouterr().out


@pytest.mark.parametrize("leftover", [False, True], ids=["fresh folder", "file left by an earlier try"])
def test_atomic_save_check_names_a_forgotten_rename(tmp_path, capsys, leftover):
    """Walkthrough w0506: a save that writes the temporary file and never renames it. In a fresh folder the check
    itself raised FileNotFoundError; with a file left by an earlier try it blamed a change of that file."""
    if leftover:
        torch.save({"step": 3, "weight": torch.ones(1000)}, tmp_path / "exercise.pt")

    def no_rename(state, path):
        torch.save(state, path.with_name(path.name + ".tmp"))

    assert not check_atomic_save(no_rename, tmp_path)
    out = capsys.readouterr().out
    assert out.startswith("Not yet") and "nothing is at `path` after a successful save" in out, out
    assert check_atomic_save(lambda state, path: save_checkpoint(path, state), tmp_path)  # the same folder, fixed


def test_atomic_save_check_rejects_a_save_that_deletes_the_old_file_before_writing_the_new_one(tmp_path, capsys):
    def unlink_first(state, path):  # a crash while pickling now leaves no file at all
        path.unlink(missing_ok=True)
        temporary = path.with_name(path.name + ".tmp")
        torch.save(state, temporary)
        os.replace(temporary, path)

    assert not check_atomic_save(unlink_first, tmp_path)
    assert "destroyed the last good checkpoint (FileNotFoundError)" in capsys.readouterr().out


def test_atomic_save_check_rejects_a_temporary_file_outside_the_checkpoints_folder(tmp_path, capsys):
    """Review 06-3: mkstemp() in the default temporary folder, then shutil.move, passes every crash on one file
    system; on a cluster (checkpoints on shared storage, /tmp on the node) the move is a copy, or os.replace raises
    EXDEV. The check reads where the renamed file came from. The same save with dir=path.parent passes."""
    import shutil
    import tempfile

    def save_via(directory):
        def save(state, path):
            handle, temporary = tempfile.mkstemp(dir=directory(path))
            with os.fdopen(handle, "wb") as file:
                torch.save(state, file)
            shutil.move(temporary, path)
        return save

    elsewhere = tmp_path / "node-local"
    elsewhere.mkdir()
    assert not check_atomic_save(save_via(lambda path: elsewhere), tmp_path / "shared")
    out = capsys.readouterr().out
    assert out.startswith("Not yet") and "not beside the checkpoint" in out and "EXDEV" in out, out
    assert check_atomic_save(save_via(lambda path: path.parent), tmp_path / "beside")


def test_weights_only_refuses_code_in_a_checkpoint(tmp_path):
    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"model": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(Exception, match="Weights only load failed"):
        load_checkpoint(tmp_path / "evil.pt")
