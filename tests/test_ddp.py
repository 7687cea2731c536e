"""Lesson 02's workers and helpers (helpers.ddp), with real launches at the smallest useful size."""
import os
import subprocess
import sys
from pathlib import Path

import torch

from helpers import WorkerFailed, launch
from helpers.data import DIGITS_NAME, load
from helpers.ddp import (
    article_source,
    check_ddp_worker,
    last_error_line,
    max_abs_diff,
    single_process_reference,
    undefined_names,
)

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "helpers" / "workers"


def test_data_falls_back_to_the_shipped_digits():
    train_set, source = load(train=True)
    test_set, _ = load(train=False)
    assert source == DIGITS_NAME and (len(train_set), len(test_set)) == (1437, 360)
    images, labels = train_set.tensors
    assert images.shape[1:] == (1, 28, 28) and images.min() >= 0 and images.max() <= 1
    assert set(labels.tolist()) == set(range(10))


def test_ddp_train_keeps_ranks_equal_saves_and_resumes_from_the_checkpoint(tmp_path):
    checkpoint = tmp_path / "ddp.pt"
    args = ["--epochs", 1, "--steps", 3, "--checkpoint", checkpoint]
    run = launch(WORKERS / "ddp_train.py", nproc=2, args=args, echo=False)
    assert run.results[0]["checksum"] == run.results[1]["checksum"]
    assert run.results[0]["accuracy"] == run.results[1]["accuracy"]
    assert run.results[0]["steps"] == 3 and run.logs.get(1, "") == ""  # only rank 0 prints
    state = torch.load(checkpoint, weights_only=True, map_location="cpu")
    assert state["epoch"] == 0 and set(state) == {"model", "optimizer", "epoch"}

    resumed = launch(WORKERS / "ddp_train.py", nproc=2, args=["--epochs", 2, "--steps", 3, "--checkpoint",
                                                              checkpoint], echo=False)
    assert "starting at epoch 1" in resumed.logs[0]
    assert [step for step, _ in resumed.metric("loss", rank=0)] == [3, 4, 5]


def test_ddp_train_runs_as_a_plain_python_script():
    """The docstring's one-process command: no torchrun, a process group of one."""
    done = subprocess.run([sys.executable, str(WORKERS / "ddp_train.py"), "--epochs", "1", "--steps", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "1 rank(s), backend gloo" in done.stdout and "epoch 0:" in done.stdout


def test_ddp_gradients_equal_one_big_batch_and_no_ddp_drifts_apart():
    run = launch(WORKERS / "ddp_equivalence.py", nproc=2, args=["--per-rank-batch", 8, "--steps", 2], echo=False)
    reference = single_process_reference(global_batch=16, steps=2)
    for rank in (0, 1):
        assert max_abs_diff(run.results[rank]["first_gradient"], reference["first_gradient"]) < 1e-6
        assert max_abs_diff(run.results[rank]["final_weights"], reference["final_weights"]) < 1e-5
    assert run.results[0]["checksum"] == run.results[1]["checksum"]
    alone = launch(WORKERS / "ddp_equivalence.py", nproc=2, args=["--no-ddp", "--steps", 1], echo=False)
    assert alone.results[0]["checksum"] != alone.results[1]["checksum"]


def test_sampler_pads_drops_and_reshuffles_only_with_set_epoch():
    run = launch(WORKERS / "ddp_sampler.py", nproc=2, args=["--size", 5, "--epochs", 2], echo=False)
    shards = [run.results[rank]["shards"] for rank in (0, 1)]
    assert shards[0]["drop_last=False"] == [0, 2, 4] and shards[1]["drop_last=False"] == [1, 3, 0]
    assert shards[0]["drop_last=True"] == [0, 2] and shards[1]["drop_last=True"] == [1, 3]
    epochs = run.results[0]["epochs"]
    assert epochs["set_epoch=False"][0] == epochs["set_epoch=False"][1]
    assert epochs["set_epoch=True"][0] != epochs["set_epoch=True"][1]


def test_article_as_printed_misses_imports_and_fails_with_name_error():
    assert undefined_names(article_source()) == ["optim", "os"]
    assert undefined_names(article_source(["imports", "port", "gloo", "data", "cpu"])) == []
    try:
        launch(WORKERS / "ddp_article_run.py", nproc=2, echo=False, timeout=60)
    except WorkerFailed as error:
        assert last_error_line(error) == "NameError: name 'os' is not defined"
    else:
        raise AssertionError("the article's tutorial ran as printed")


def test_article_with_every_fix_trains():
    fixes = ["imports", "port", "gloo", "data", "cpu"]
    run = launch(WORKERS / "ddp_article_run.py", nproc=2, args=[a for f in fixes for a in ("--fix", f)],
                 echo=False, timeout=90)
    assert run.logs[0].split("\n")[:2] == ["Epoch 0 complete", "Epoch 1 complete"]


def test_exercise_check_passes_the_solution_and_rejects_the_unchanged_script(capsys):
    assert check_ddp_worker(WORKERS / "ddp_exercise_solution.py")
    assert not check_ddp_worker(WORKERS / "ddp_exercise_single.py")
    assert "shard the data with DistributedSampler" in capsys.readouterr().out
