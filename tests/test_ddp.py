"""Lesson 02's workers and helpers (helpers.ddp), with real launches at the smallest useful size."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO_ROOT as ROOT
from helpers import WorkerFailed, launch
from helpers.article import article_source
from helpers.data import DIGITS_NAME, load
from helpers.ddp import check_ddp_worker, last_error_line, single_process_reference, undefined_names
from helpers.tensors import max_abs_diff

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
    assert "global batch 64 = 2 x 32" in run.logs[0]
    state = torch.load(checkpoint, weights_only=True, map_location="cpu")
    assert state["epoch"] == 0 and state["step"] == 3 and set(state) == {"model", "optimizer", "epoch", "step"}

    resumed = launch(WORKERS / "ddp_train.py", nproc=2, args=["--epochs", 2, "--steps", 6, "--checkpoint",
                                                              checkpoint], echo=False)
    assert "starting at epoch 1" in resumed.logs[0]
    assert [step for step, _ in resumed.metric("loss", rank=0)] == [3, 4, 5]  # --steps is a total


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


def test_ddp_broadcasts_rank_0s_weights_at_construction_unless_init_sync_is_off():
    run = launch(WORKERS / "ddp_broadcast.py", nproc=2, echo=False)
    rank0, rank1 = (run.results[rank]["checksums"] for rank in (0, 1))
    assert rank0["init_sync=True"]["before"] != rank1["init_sync=True"]["before"]  # seeded differently
    assert rank1["init_sync=True"]["after"] == rank0["init_sync=True"]["before"]
    assert rank1["init_sync=False"]["after"] == rank1["init_sync=False"]["before"]


def test_download_on_every_rank_races_and_rank_0_plus_barrier_does_not():
    race = launch(WORKERS / "ddp_download_race.py", nproc=2, echo=False).results
    downloads = sum(race[rank]["action"] == "downloaded" for rank in (0, 1))
    assert downloads == 2 or not all(race[rank]["complete"] for rank in (0, 1))
    fixed = launch(WORKERS / "ddp_download_race.py", nproc=2, args=["--fix"], echo=False).results
    assert [fixed[rank]["action"] for rank in (0, 1)] == ["downloaded", "waited for rank 0"]
    assert all(fixed[rank]["complete"] for rank in (0, 1))


def test_batchnorm_buffers_follow_rank_0_only_with_forward_sync_and_syncbn_needs_a_gpu():
    run = launch(WORKERS / "ddp_batchnorm.py", nproc=2, args=["--per-rank-batch", 8, "--steps", 2], echo=False)
    outcomes = [run.results[rank]["outcomes"] for rank in (0, 1)]
    synced, unsynced = "BatchNorm, forward_sync_buffers=True", "BatchNorm, forward_sync_buffers=False"
    assert outcomes[0][synced]["running_mean_at_forward"] == outcomes[1][synced]["running_mean_at_forward"]
    assert outcomes[0][unsynced]["running_mean_at_forward"][1] != outcomes[1][unsynced]["running_mean_at_forward"][1]
    assert outcomes[0][synced]["gradient_diff"] > 1e-3  # local batch statistics: not one big batch's gradient
    if not torch.cuda.is_available():
        assert "only work with GPU" in outcomes[0]["SyncBatchNorm"]["error"]


def test_uneven_inputs_break_without_join_and_finish_with_it():
    broken = launch(WORKERS / "ddp_uneven.py", nproc=2, echo=False, timeout=90).results
    assert broken[1]["steps"] == 3 and broken[0]["steps"] == 3 and "error" in broken[0]
    joined = launch(WORKERS / "ddp_uneven.py", nproc=2, args=["--join"], echo=False, timeout=90).results
    assert [joined[rank]["steps"] for rank in (0, 1)] == [5, 3]
    assert joined[0]["checksum"] == joined[1]["checksum"]


def test_step_time_pins_the_thread_count_it_reports_and_the_waiting_rank_sleeps():
    run = launch(WORKERS / "ddp_step_time.py", nproc=2, echo=False,
                 args=["--model", "simple", "--block-steps", 2, "--warmup", 1, "--repeats", 2])
    blocks = run.results[0]["blocks"]
    assert sorted(blocks) == ["simple, 1 rank(s) x 1 thread(s)", "simple, 1 rank(s) x 2 thread(s)",
                              "simple, 2 rank(s) x 1 thread(s)"]
    assert all(len(times) == 2 and min(times) > 0 for times in blocks.values())
    waited = run.results[1]["waited"]
    assert waited["cpu_seconds"] < 0.25 * waited["wall_seconds"]


def test_torch_distributed_launch_warns_and_passes_local_rank():
    done = subprocess.run([sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "1",
                           str(WORKERS / "ddp_launch_env.py")], capture_output=True, text=True, timeout=120)
    assert "FutureWarning: The module torch.distributed.launch is deprecated" in done.stderr
    assert "arguments: ['--local-rank=0']" in done.stdout


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


def test_exercise_check_says_not_yet_on_the_start_and_correct_on_the_solution(capsys):
    assert not check_ddp_worker(WORKERS / "ddp_exercise_single.py")
    assert capsys.readouterr().out.startswith("Not yet: the ranks trained on [256, 256] samples")
    assert check_ddp_worker(WORKERS / "ddp_exercise_solution.py")
    assert capsys.readouterr().out.startswith("Correct: ")


@pytest.mark.parametrize("mistake, replacement, message", [
    ("ddp_model = DDP(model)", "ddp_model = model", "wrap the model in DistributedDataParallel"),
    ("batch_size=GLOBAL_BATCH // world_size", "batch_size=GLOBAL_BATCH", "GLOBAL_BATCH // world_size"),
])
def test_exercise_check_names_what_is_missing(tmp_path, capsys, mistake, replacement, message):
    solution = (WORKERS / "ddp_exercise_solution.py").read_text()
    assert mistake in solution
    script = tmp_path / "attempt.py"
    script.write_text(solution.replace(mistake, replacement))
    assert not check_ddp_worker(script)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and message in out
