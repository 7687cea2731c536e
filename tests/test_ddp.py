"""Lesson 02's helpers (helpers.lessons.ddp, helpers.kit.data) and the exercise's check. The lesson's workers are
launched, and asserted, by the lesson (notebooks/02_ddp.ipynb, under pytest --nbval); here only what the lesson does not
check: ddp_train.py's --steps and its one-process command, the article fixed in full, and that the exercise's check says
"Not yet" to wrong workers and "Correct" to the solution."""
import os
import subprocess
import sys

import pytest

from helpers import REPO_ROOT as ROOT
from helpers import launch
from helpers.kit.data import DIGITS_NAME, load
from helpers.kit.ddp import article_source
from helpers.lessons.ddp import check_ddp_worker, undefined_names

WORKERS = ROOT / "helpers" / "workers"


def test_data_falls_back_to_the_shipped_digits():
    train_set, source = load(train=True)
    test_set, _ = load(train=False)
    assert source == DIGITS_NAME and (len(train_set), len(test_set)) == (1437, 360)
    images, labels = train_set.tensors
    assert images.shape[1:] == (1, 28, 28) and images.min() >= 0 and images.max() <= 1
    assert set(labels.tolist()) == set(range(10))


def test_ddp_train_stops_at_steps_in_total_with_equal_replicas():
    """--steps, which the lesson never passes; and equal weights (the lesson asserts equal accuracy only)."""
    run = launch(WORKERS / "ddp_train.py", nproc=2, args=["--epochs", 1, "--steps", 3], echo=False)
    assert run.results[0]["steps"] == run.results[1]["steps"] == 3
    assert [step for step, _ in run.metric("loss", rank=0)] == [0, 1, 2]
    assert run.results[0]["checksum"] == run.results[1]["checksum"]
    assert "global batch 64 = 2 x 32" in run.logs[0]


def test_ddp_train_runs_as_a_plain_python_script():
    """The docstring's one-process command: no torchrun, a process group of one."""
    done = subprocess.run([sys.executable, str(WORKERS / "ddp_train.py"), "--epochs", "1", "--steps", "2"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert "1 rank(s), backend gloo" in done.stdout and "epoch 0:" in done.stdout


def test_article_with_every_fix_leaves_no_undefined_name():
    """The lesson checks the names the article as printed misses; here, that the fixes supply all of them."""
    assert undefined_names(article_source(["imports", "port", "gloo", "data", "cpu"])) == []


def test_exercise_check_says_not_yet_on_the_start_and_correct_on_both_solutions(capsys):
    assert not check_ddp_worker(WORKERS / "ddp_exercise_single.py")
    assert "\nNot yet: the ranks trained on [256, 256] samples" in capsys.readouterr().out
    for solution in ("ddp_exercise_solution.py", "ddp_exercise_by_hand_solution.py"):
        assert check_ddp_worker(WORKERS / solution), solution
        assert "\nCorrect: " in capsys.readouterr().out


def _attempt(tmp_path, solution: str, mistake: str, replacement: str):
    """A learner's wrong answer: a solution file with one line changed, written to tmp_path/attempt.py."""
    text = (WORKERS / solution).read_text()
    assert mistake in text
    script = tmp_path / "attempt.py"
    script.write_text(text.replace(mistake, replacement))
    return script


@pytest.mark.parametrize("solution, mistake, replacement, message", [
    ("ddp_exercise_solution.py", "ddp_model = DDP(model)", "ddp_model = model",
     "wrap the model in DistributedDataParallel"),
    ("ddp_exercise_solution.py", "batch_size=GLOBAL_BATCH // world_size", "batch_size=GLOBAL_BATCH",
     "every step averaged 64 samples: use a per-rank batch of GLOBAL_BATCH // world_size"),
    # DistributedSampler's default shuffles: the right samples per rank, in another order
    ("ddp_exercise_solution.py", "DistributedSampler(train_set, shuffle=False)", "DistributedSampler(train_set)",
     "default shuffled order: pass DistributedSampler(..., shuffle=False)"),
    # by hand: forgetting the all_reduce leaves each rank with its own gradients
    ("ddp_exercise_by_hand_solution.py", "dist.all_reduce(parameter.grad)", "pass",
     "all_reduce every parameter's .grad and divide it by world_size"),
    # by hand: the sum of the gradients, not their mean, is a step twice as large
    ("ddp_exercise_by_hand_solution.py", "parameter.grad /= world_size", "pass",
     "summed over the ranks and not averaged: divide the all_reduce's sum by world_size"),
])
def test_exercise_check_names_what_is_missing(tmp_path, capsys, solution, mistake, replacement, message):
    assert not check_ddp_worker(_attempt(tmp_path, solution, mistake, replacement))
    out = capsys.readouterr().out
    assert "\nNot yet: " in out and message in out


def test_exercise_check_says_where_each_rank_waits_when_the_script_hangs(tmp_path, capsys):
    # the walkthrough's wrong answer: broadcast the starting weights on rank 0 only. Rank 0 waits in a
    # broadcast that rank 1 never joins, and rank 1 waits in an all_reduce that rank 0 never reaches.
    mistake = "        dist.broadcast(parameter.data, src=0)"
    script = _attempt(tmp_path, "ddp_exercise_by_hand_solution.py", mistake, "        if rank == 0:\n    " + mistake)
    assert not check_ddp_worker(script, timeout=20)
    out = capsys.readouterr().out
    assert out.startswith("Running attempt.py on 2 ranks") and "press Stop (■)" in out.splitlines()[0]
    verdict = out[out.index("Not yet: "):]
    assert verdict.startswith("Not yet: your script was still running after 20 s")
    # each rank's location, not the bare "Full stacks: runs  Logs: runs" the old message left
    assert "rank 0: " in verdict and "rank 1: " in verdict and "attempt.py" in verdict


def test_exercise_check_says_print_only_on_rank_0(tmp_path, capsys):
    script = _attempt(tmp_path, "ddp_exercise_solution.py", "    if rank == 0:\n        print(",
                      "    if True:\n        print(")
    assert not check_ddp_worker(script)
    out = capsys.readouterr().out
    assert "Not yet: the training is right, but rank 1 printed too" in out and "print only on rank 0" in out


def test_exercise_reference_computed_in_process_equals_a_launch_of_the_original():
    """The check's one-process reference is computed in the notebook's process, not by launching
    ddp_exercise_single.py (which a learner may edit). It must still be what that file computes."""
    from helpers.kit.tensors import max_abs_diff
    from helpers.lessons.ddp import _one_process_reference

    launched = launch(WORKERS / "ddp_exercise_single.py", nproc=1, echo=False).results[0]
    reference = _one_process_reference()
    assert reference["samples_seen"] == launched["samples_seen"] == 256
    assert max_abs_diff(reference["weights"], launched["weights"]) < 1e-5


def test_a_broken_original_does_not_break_the_exercise_check(tmp_path, monkeypatch, capsys):
    """A learner who edits (and breaks) ddp_exercise_single.py instead of the copy still gets a working check:
    the check launches only the learner's script, and no file under a WORKERS folder it could read."""
    import helpers
    import helpers.kit
    import helpers.launcher.api as api

    broken = tmp_path / "ddp_exercise_single.py"
    broken.write_text((WORKERS / "ddp_exercise_single.py").read_text().replace("import torch\n", "", 1)
                      + "\nraise SystemExit('a broken original')\n")
    monkeypatch.setattr(helpers, "WORKERS", tmp_path)
    monkeypatch.setattr(helpers.kit, "WORKERS", tmp_path)
    launched, real_launch = [], api.launch
    monkeypatch.setattr(api, "launch", lambda script, *a, **k: launched.append(script) or real_launch(script, *a, **k))
    solution = WORKERS / "ddp_exercise_solution.py"
    assert check_ddp_worker(solution)
    assert "\nCorrect: " in capsys.readouterr().out
    assert launched == [solution]


def test_step_time_reading_prints_the_protocols_verdicts(capsys):
    """Section 7 reads ddp_step_time.py's timings through verdict(): "faster" only where every round of one setting
    beat every round of the other, "not distinguishable on this machine" otherwise, wall and CPU time apart."""
    from helpers.kit.timing import NOT_DISTINGUISHABLE, Timing
    from helpers.lessons.ddp import read_step_times, step_settings

    def rounds(centre: float, spread: float) -> list[float]:
        return [(centre + spread * k) / 1e3 for k in (-2, -1, 0, 1, 2)]

    timings = {}
    for model in ("simple", "cnn"):
        names = step_settings(model)
        ddp_spread = 0.1 if model == "simple" else 3.0  # the CNN's DDP rounds overlap the one-process rounds
        for role, centre, spread in (("one", 10.0, 0.1), ("two_threads", 10.0, 0.1), ("half", 5.0, 0.1),
                                     ("quiet", 6.0, 0.1), ("ddp", 14.0, ddp_spread), ("bare", 1.0, 0.1)):
            wall = rounds(centre, spread)
            cpu = rounds(2 * centre if role in ("ddp", "quiet", "bare") else centre, 0.1)  # two ranks' CPU add up
            timings[names[role]] = Timing(names[role], wall, cpu)
    verdicts = read_step_times(timings, {"simple": 8070, "cnn": 20490})
    out = capsys.readouterr().out
    assert verdicts["simple"]["ddp"].faster == "simple, 1 rank, 1 thread" and not verdicts["cnn"]["ddp"].distinguishable
    assert "DDP on 2 ranks against 1 rank, 1 thread (wall): 1 rank, 1 thread is faster, 1.40x" in out
    assert f"DDP on 2 ranks against 1 rank, 1 thread (wall): {NOT_DISTINGUISHABLE}" in out
    assert not verdicts["simple"]["threads"].distinguishable and verdicts["simple"]["all-reduce cpu"].distinguishable
    assert "  DDP, 2 ranks" in out and "wall 14.0 ms (13.8-14.2)" in out


def test_exercise_check_names_the_learners_line_when_the_script_crashes(tmp_path, capsys):
    """A crash in the learner's own line gets not_yet_crashed's paragraph: the rank, the learner's file:line, the
    error, and the run folder."""
    script = _attempt(tmp_path, "ddp_exercise_solution.py", "    samples_seen = 0\n",
                      "    samples_seen = 0\n    raise ValueError(f'bad shard on rank {rank}')\n")
    line = script.read_text().splitlines().index("    raise ValueError(f'bad shard on rank {rank}')") + 1
    assert not check_ddp_worker(script)
    out = capsys.readouterr().out
    verdict = out[out.index("Not yet: "):]
    assert verdict.startswith("Not yet: your script crashed on rank ")
    assert f"at attempt.py:{line} (in main)" in verdict and "ValueError: bad shard on rank" in verdict
    assert "Everything each rank printed is in " in verdict and "(rank<N>.log)" in verdict


def test_failure_report_keeps_what_a_learner_reads_and_drops_what_changes():
    """failure_report() cuts torchrun's ChildFailedError report out of its output and replaces times, hosts, process
    ids, temporary folders, ports and absolute paths, so that a stored report reads the same on any machine."""
    from helpers.lessons.ddp import failure_report

    output = """[rank1]: ValueError: boom
E1206 12:34:07.140000 16342 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/home/ana/course/helpers/workers/ddp_failure_report.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-06_12:34:19
  host      : node17.cluster
  rank      : 1 (local_rank: 1)
  exitcode  : 1 (pid: 16693)
  error_file: /tmp/torchelastic_8acl8vn6/22eb_s3nqy2pa/attempt_0/1/error.json
  traceback : Traceback (most recent call last):
    File "/home/ana/.venv/lib/python3.11/site-packages/torch/distributed/c10d_logger.py", line 83, in wrapper
  RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer \
[127.0.0.1]:18323. Signal 15 (SIGTERM) received by PID 16406
============================================================"""
    report = failure_report(output)
    assert report.startswith("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:")
    assert "helpers/workers/ddp_failure_report.py FAILED" in report.splitlines()[2]
    for gone in ("ana", "node17", "12:34", "16693", "16406", "torchelastic_8acl8vn6", "18323", "/__w/", "ValueError"):
        assert gone not in report, gone
    assert 'File "torch/distributed/c10d_logger.py", line 83' in report and "[third_party/gloo" in report
    assert "<torchrun's temporary folder>/attempt_0/1/error.json" in report and "rank      : 1" in report


def test_exercise_check_says_a_rank_left_when_a_collective_runs_on_rank_0_only(tmp_path, capsys):
    # the seventh walkthrough's wrong answer: the by-hand all_reduce only on rank 0. On gloo it does not hang:
    # rank 1 finishes and exits, rank 0's all_reduce loses its peer. The check must say that, not a bare "runs".
    mistake = "            dist.all_reduce(parameter.grad)"
    script = _attempt(tmp_path, "ddp_exercise_by_hand_solution.py", mistake,
                      "            if rank == 0:\n    " + mistake)
    assert not check_ddp_worker(script, timeout=30)
    out = capsys.readouterr().out
    verdict = out[out.index("Not yet: "):]
    if "still running after" in verdict:  # it hung instead (possible on another backend or a slower exit)
        assert "rank 0: " in verdict
    else:
        assert "same collectives in the same order" in verdict and "rank" in verdict and not verdict.endswith("runs")
