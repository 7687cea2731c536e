"""Lesson 13 with real launches: the exercise's check accepts right hooks of several designs and names the mistake of
each wrong one (all in one 2-rank launch), reports a crash with the rank and the learner's line, the compile worker
says what to do without a C++ compiler, and the hooks worker counts every hook's bytes and ends cleanly."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import launch
from helpers.kit import WORKERS
from helpers.kit.faster_step import NO_COMPILER
from helpers.lessons.faster_step import check_hook, check_hooks, hooks_table

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = (WORKERS / "faster_hook_solution.py").read_text()
NOTEBOOK = ROOT / "notebooks" / "13_faster_step.ipynb"

CAST_BACK = "return summed.to(buffer.dtype).div_(group.size())"
ISSUE = "    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n"

RIGHT = {  # right, built differently: each must pass
    "solution.py": [],
    "float16.py": [("torch.bfloat16", "torch.float16")],
    "divide_first.py": [("compressed = buffer.to(torch.bfloat16)",
                         "compressed = buffer.div(group.size()).to(torch.bfloat16)"),
                        (CAST_BACK, "return summed.to(buffer.dtype)")],
    "copy_into_bucket.py": [(CAST_BACK, "return buffer.copy_(summed).div_(group.size())")],
    "wait_then_complete.py": [(ISSUE, "    dist.all_reduce(compressed, group=group)\n"
                                      "    future = torch.futures.Future()\n    future.set_result([compressed])\n")],
}
TORCHS_OWN = ("from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook\n\n\n"
              "def compress_hook(process_group, bucket):\n    return fp16_compress_hook(process_group, bucket)\n")

WRONG = {  # a learner's mistakes -> the words the check must say
    "no_division.py": ([(CAST_BACK, "return summed.to(buffer.dtype)")], "2.00 times the exact average: divide"),
    "divided_twice.py": ([("compressed = buffer.to(torch.bfloat16)",
                           "compressed = buffer.div(group.size()).to(torch.bfloat16)")],
                         "divided by the number of ranks twice"),
    "stays_16_bits.py": ([(CAST_BACK, "return summed.div_(group.size())")],
                         "holds torch.bfloat16 values: cast the sum back"),
    "all_reduced_twice.py": ([(ISSUE, "    dist.all_reduce(compressed, group=group)\n" + ISSUE)],
                             "issued 2 all-reduce calls for 1 bucket"),
    "unfinished_future.py": ([("    return future.then(decompress)", "    return torch.futures.Future()")],
                             "still not complete 2 s later"),
    "raw_future.py": ([("    return future.then(decompress)", "    return future")], "holds a list, not one tensor"),
    "returns_a_tensor.py": ([("    return future.then(decompress)", "    return buffer")],
                            "returned a Tensor, not a torch.futures.Future"),
    "sends_float32.py": ([("compressed = buffer.to(torch.bfloat16)", "compressed = buffer.clone()")],
                         "handed 4 bytes per gradient value"),
    "keeps_its_own.py": ([(CAST_BACK, "return buffer")], "differ from the exact average"),
    "callback_error.py": ([("        summed = done.value()[0]\n", "        summed = done.value()[0]\n        oops\n")],
                          "raised NameError: name 'oops' is not defined at callback_error.py:"),
    "broadcasts.py": ([("dist.all_reduce(compressed, group=group, async_op=True)",
                        "dist.broadcast(compressed, src=0, group=group, async_op=True)")], "called ['broadcast']"),
    "wrong_name.py": ([("def compress_hook(", "def compression_hook(")], "defines no function compress_hook"),
}


def mutate(changes: list[tuple[str, str]]) -> str:
    source = SOLUTION
    for old, new in changes:
        assert old in source, old
        source = source.replace(old, new)
    return source


def test_the_check_passes_right_hooks_and_names_each_mistake(tmp_path):
    files = {}
    for name, changes in RIGHT.items():
        files[name] = mutate(changes)
    files["torchs_own.py"] = TORCHS_OWN
    for name, (changes, _) in WRONG.items():
        files[name] = mutate(changes)
    starting = next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                    if "".join(c["source"]).startswith("%%writefile my_compress_hook.py"))
    files["my_compress_hook.py"] = starting.split("\n", 1)[1]
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    lines = check_hooks([tmp_path / name for name in files])
    for name in [*RIGHT, "torchs_own.py"]:
        assert lines[name].startswith("Correct: "), (name, lines[name])
    for name, (_, words) in WRONG.items():
        assert lines[name].startswith("Not yet: rank ") and words in lines[name], (name, lines[name])
    assert "handed 4 bytes per gradient value" in lines["my_compress_hook.py"]  # the notebook's starting code


def test_a_crash_names_the_rank_and_the_learners_line(tmp_path, capsys):
    crash = tmp_path / "crash.py"
    crash.write_text(mutate([("    buffer = bucket.buffer()\n", "    buffer = bucket.buffer()\n    typo_here\n")]))
    assert not check_hook(crash)
    out = capsys.readouterr().out
    assert re.search(r"Not yet: the check of crash\.py crashed on rank \d at crash\.py:\d+", out), out
    assert "NameError: name 'typo_here' is not defined" in out


def test_the_compile_worker_says_what_to_do_without_a_compiler(monkeypatch):
    """CXX names a compiler that does not exist: inductor's own lookup fails in the workers, and the worker hands back
    our sentence instead of failing in the first step. Fresh interpreters: inductor reads CXX when its config is
    imported, and workers forked from the launch server inherit the server's config (imported before this test)."""
    monkeypatch.setenv("CXX", "no-such-c++-compiler-lesson13")
    run = launch(WORKERS / "faster_compile.py", nproc=2, echo=False, timeout=300, args=["--parts", "inductor"],
                 fresh=True)
    skipped = run.results[0]["inductor"]["skipped"]
    assert skipped.startswith(NO_COMPILER.split("{detail}")[0]) and "no-such-c++-compiler-lesson13" in skipped


@pytest.mark.parametrize("attempt", [1, 2])
def test_the_hooks_worker_counts_every_hook_and_ends_cleanly(attempt):
    """Small: 4 steps. Every hook's bytes equal the formula on both ranks; run twice, because a process group left to
    die on one of gloo's threads aborted the worker at exit now and then (helpers.kit.faster_step.release)."""
    run = launch(WORKERS / "faster_hooks.py", nproc=2, echo=False, timeout=300, args=["--steps", "4", "--rounds", "5"])
    table = hooks_table(run.results)
    assert all(row["counted"] == row["formula"] and row["same_on_every_rank"] for row in table.values()), table
    assert table["PowerSGD r=1"]["calls"] == 3 and table["fp16"]["calls"] == 1
