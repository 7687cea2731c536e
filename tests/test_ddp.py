"""Lesson 02's launches that the lesson does not assert: ddp_train.py's --steps and its one-process command, the
one-process reference of the exercise's check, and the check's "Not yet" to wrong workers (a missing DDP, a wrong
batch, a shuffled sampler, a missing or unaveraged all_reduce, the weights averaged instead of the gradients, ranks
seeded differently without a broadcast, zero_grad after the step, no process group, a hang, a collective on rank 0
only, prints on every rank, a crash in the learner's own line) and its "Correct" to right answers built differently.
The check on the starting code and on both solutions is asserted by the lesson (notebooks/02_ddp.ipynb, the
exercise's cells); what launches nothing is in tests/fast/test_ddp_no_launch.py."""
import os
import subprocess
import sys

import pytest
import torch

from helpers import REPO_ROOT as ROOT
from helpers import launch
from helpers.lessons.ddp import check_ddp_worker

WORKERS = ROOT / "helpers" / "workers"


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
    # contiguous halves (rank 0 the first 128 samples): each rank its own half, but other samples in each step
    ("ddp_exercise_solution.py", "sampler = DistributedSampler(train_set, shuffle=False)",
     "sampler = range(rank * len(train_set) // world_size, (rank + 1) * len(train_set) // world_size)",
     "deal the samples in turn, as DistributedSampler(shuffle=False) does"),
    # by hand: forgetting the all_reduce leaves each rank with its own gradients
    ("ddp_exercise_by_hand_solution.py", "dist.all_reduce(parameter.grad)", "pass",
     "all_reduce every parameter's .grad and divide it by world_size"),
    # by hand: the sum of the gradients, not their mean, is a step twice as large
    ("ddp_exercise_by_hand_solution.py", "parameter.grad /= world_size", "pass",
     "summed over the ranks and not averaged: divide the all_reduce's sum by world_size"),
    # by hand: the WEIGHTS averaged after each step, not the gradients before it (the same end with plain SGD)
    ("ddp_exercise_by_hand_solution.py",
     "        for parameter in model.parameters():  # what DDP does during backward: average the gradients\n"
     "            dist.all_reduce(parameter.grad)  # the sum over the ranks ...\n"
     "            parameter.grad /= world_size  # ... divided: the mean of the per-rank means, one big batch's\n"
     "        optimizer.step()\n", """        optimizer.step()
        with torch.no_grad():
            for parameter in model.parameters():
                dist.all_reduce(parameter.data)
                parameter.data /= world_size
""", "the ranks averaged something after optimizer.step(), the weights perhaps, not the gradients before it"),
    # by hand: every rank seeded by its rank, and no broadcast of rank 0's weights
    ("ddp_exercise_by_hand_solution.py", """    torch.manual_seed(0)
    model = build_model("simple").to(device)
    for parameter in model.parameters():  # what DDP's constructor does: everyone starts from rank 0's weights
        dist.broadcast(parameter.data, src=0)
""", """    torch.manual_seed(rank)
    model = build_model("simple").to(device)
""", "they started from different weights. Start every rank from rank 0's weights: dist.broadcast(parameter.data"),
    # zero_grad() moved after the step: .grad is None when result() reads it
    ("ddp_exercise_solution.py", """        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
""", """        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
""", "keep optimizer.zero_grad() before loss.backward()"),
])


def test_exercise_check_names_what_is_missing(tmp_path, capsys, solution, mistake, replacement, message):
    assert not check_ddp_worker(_attempt(tmp_path, solution, mistake, replacement))
    out = capsys.readouterr().out
    assert "\nNot yet: " in out and message in out


@pytest.mark.parametrize("solution, mistake, replacement", [
    # DDP broadcasts rank 0's weights when it wraps the model: seeding each rank differently is harmless
    ("ddp_exercise_solution.py", "torch.manual_seed(0)", "torch.manual_seed(rank)"),
    # by hand with the broadcast: the same
    ("ddp_exercise_by_hand_solution.py", "torch.manual_seed(0)", "torch.manual_seed(rank)"),
])
def test_exercise_check_accepts_right_answers_built_differently(tmp_path, capsys, solution, mistake, replacement):
    assert check_ddp_worker(_attempt(tmp_path, solution, mistake, replacement))
    assert "\nCorrect: " in capsys.readouterr().out


def test_exercise_check_names_the_missing_process_group(tmp_path, capsys):
    """A learner's script without init_process_group: the first line that needs the group (DistributedSampler, which
    asks it for the world size) raises, and the message names that line of the learner's and torch's error."""
    script = _attempt(tmp_path, "ddp_exercise_solution.py",
                      '    dist.init_process_group("nccl" if use_cuda else "gloo")\n'
                      "    rank, world_size = dist.get_rank(), dist.get_world_size()\n",
                      '    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])\n')
    lines = script.read_text().splitlines()
    line = next(number for number, text in enumerate(lines, 1) if "DistributedSampler(" in text)
    assert not check_ddp_worker(script)
    verdict = capsys.readouterr().out
    verdict = verdict[verdict.index("Not yet: "):]
    assert verdict.startswith("Not yet: your script crashed on rank ")
    assert f"attempt.py:{line} (in main)" in verdict and "Default process group has not been initialized" in verdict


def test_exercise_check_says_where_each_rank_waits_when_the_script_hangs(tmp_path, capsys):
    # the walkthrough's wrong answer: broadcast the starting weights on rank 0 only. Rank 0 waits in a
    # broadcast that rank 1 never joins, and rank 1 waits in an all_reduce that rank 0 never reaches.
    mistake = "        dist.broadcast(parameter.data, src=0)"
    script = _attempt(tmp_path, "ddp_exercise_by_hand_solution.py", mistake, "        if rank == 0:\n    " + mistake)
    assert not check_ddp_worker(script, timeout=8)  # both ranks wait within a second or two of the start
    out = capsys.readouterr().out
    assert out.startswith("Running attempt.py on 2 ranks") and "press Stop (■)" in out.splitlines()[0]
    verdict = out[out.index("Not yet: "):]
    assert verdict.startswith("Not yet: your script was still running after 8 s")
    # each rank's location, not the bare "Full stacks: runs  Logs: runs" the old message left
    assert "rank 0: waiting in dist.broadcast at attempt.py:" in verdict, verdict
    assert "rank 1: waiting in dist.all_reduce at attempt.py:" in verdict, verdict


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


def test_exercise_check_says_a_rank_left_when_a_collective_runs_on_rank_0_only(tmp_path, capsys):
    # the seventh walkthrough's wrong answer: the by-hand all_reduce only on rank 0. On gloo it does not hang:
    # rank 1 finishes and exits, rank 0's all_reduce loses its peer. The check must say that, not a bare "runs".
    mistake = "            dist.all_reduce(parameter.grad)"
    script = _attempt(tmp_path, "ddp_exercise_by_hand_solution.py", mistake,
                      "            if rank == 0:\n    " + mistake)
    assert not check_ddp_worker(script, timeout=30)
    out = capsys.readouterr().out
    verdict = out[out.index("Not yet: "):]
    if torch.cuda.is_available():  # the script picks nccl, which does not notice a peer that left: rank 0 hangs
        assert verdict.startswith("Not yet: your script was still running after 30 s") and "rank 0: " in verdict
    else:  # gloo, always here: no rank raised, rank 1 left while rank 0 waited; the check says what that means
        assert verdict.startswith("Not yet: your script failed on 2 ranks: rank 1 failed first, with no Python error")
        assert "every rank must call the same collectives in the same order" in verdict


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
    assert "Each rank's output and traceback are in " in verdict and "rank<N>.log" in verdict
