"""Lesson 13 with real launches: the exercise's check (3 ranks, a process group that is not WORLD) accepts right
hooks of several designs and names the mistake of each wrong one, a fresh reader's among them (all in one launch);
refuses torch's own hook as the learner's work; reports a crash with the rank and the learner's line. Every worker
runs small, and every function the notebook calls runs on its results: the hooks (bytes against the formula, twice,
ending cleanly), the profiler's trace file (lesson 03's issue order, the bytes the trace records), the compile
worker without a C++ compiler (graphs per bucket cap, compiled autograd), FSDP2 compiled four ways, the matmul
rate, and the closing note."""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import matplotlib
import pytest

from helpers import launch
from helpers.kit import WORKERS
from helpers.kit.faster_step import NO_COMPILER, build_model
from helpers.kit.models import mlp
from helpers.lessons.faster_step import (
    check_hook,
    check_hooks,
    closing_note,
    flops_formula,
    fraction_table,
    fsdp_table,
    hook_timings,
    hooks_figure,
    hooks_table,
    powersgd_values_per_step,
    print_split_table,
    profile_table,
    split_figure,
    timeline_figure,
)

matplotlib.use("Agg")
ROOT = Path(__file__).resolve().parent.parent
SOLUTION = (WORKERS / "faster_hook_solution.py").read_text()
NOTEBOOK = ROOT / "notebooks" / "13_faster_step.ipynb"

CAST_BACK = "return summed.to(buffer.dtype).div_(group.size())"
ISSUE = "    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n"
GROUP = "group = process_group if process_group is not None else dist.group.WORLD"
HEADER = "import torch\nimport torch.distributed as dist\n\n\ndef compress_hook(process_group, bucket):\n"

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
READER_RIGHT = {  # a fresh reader's right hook (ReduceOp.AVG), verbatim
    "avg_op.py": HEADER + f"    {GROUP}\n    buffer = bucket.buffer()\n    compressed = buffer.to(torch.bfloat16)\n"
                 "    future = dist.all_reduce(compressed, op=dist.ReduceOp.AVG, group=group, async_op=True)"
                 ".get_future()\n    return future.then(lambda done: done.value()[0].to(buffer.dtype))\n",
}

WRONG = {  # a learner's mistakes -> the words the check must say
    "no_division.py": ([(CAST_BACK, "return summed.to(buffer.dtype)")], "3.00 times the exact average: divide"),
    "divided_twice.py": ([("compressed = buffer.to(torch.bfloat16)",
                           "compressed = buffer.div(group.size()).to(torch.bfloat16)")],
                         "divided by the number of ranks twice"),
    "world_size.py": ([(CAST_BACK, "return summed.to(buffer.dtype).div_(dist.get_world_size())")],
                      "divided by 3, every rank's count (dist.get_world_size()); the group DDP handed your hook has"),
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
    "keeps_its_own.py": ([(CAST_BACK, "return buffer")], "this rank's own gradients, scaled, not the all-reduced sum"),
    "callback_error.py": ([("        summed = done.value()[0]\n", "        summed = done.value()[0]\n        oops\n")],
                          "raised NameError: name 'oops' is not defined at callback_error.py:"),
    # group_src, not src=0: global rank 0 is not in rank 2's group, which would crash rank 2 alone (a hang here)
    "broadcasts.py": ([("dist.all_reduce(compressed, group=group, async_op=True)",
                        "dist.broadcast(compressed, group_src=0, group=group, async_op=True)")],
                       "called ['broadcast']"),
    "wrong_name.py": ([("def compress_hook(", "def compression_hook(")], "defines no function compress_hook"),
    "torchs_bf16.py": ([("    return future.then(decompress)",
                         "    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks\n"
                         "    return default_hooks.bf16_compress_hook(process_group, bucket)")],
                       "let torch's own hook issue the all-reduce (default_hooks.py (_compress_hook)"),
}
READER_WRONG = {  # a fresh reader's wrong hooks (reviews r13-1), verbatim -> the words naming each mistake
    "hardcoded_two.py": (HEADER + f"    {GROUP}\n    buffer = bucket.buffer()\n"
                         "    compressed = buffer.to(torch.bfloat16)\n"
                         "    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n"
                         "    # \"two ranks\": the learner divides by the number they see in the lesson\n"
                         "    return future.then(lambda done: done.value()[0].to(buffer.dtype).div_(2))\n",
                         "the all-reduced sum was divided by 2, but the group has 3 ranks"),
    "no_return.py": (HEADER + f"    {GROUP}\n    buffer = bucket.buffer()\n    compressed = buffer.to(torch.bfloat16)\n"
                     "    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n\n"
                     "    def decompress(done):\n"
                     "        # writes the average into the bucket, but forgets to return it\n"
                     "        buffer.copy_(done.value()[0]).div_(group.size())\n\n    return future.then(decompress)\n",
                     "your callback returned None"),
    "ignores_sum.py": (HEADER + f"    {GROUP}\n    buffer = bucket.buffer()\n"
                       "    compressed = buffer.to(torch.bfloat16)\n"
                       "    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n"
                       "    # divides the bucket it was given, not the all-reduced sum\n"
                       "    return future.then(lambda done: buffer.div_(group.size()))\n",
                       "this rank's own gradients, scaled, not the all-reduced sum"),
    "ignores_group.py": (HEADER + "    buffer = bucket.buffer()\n    compressed = buffer.to(torch.bfloat16)\n"
                         "    future = dist.all_reduce(compressed, async_op=True).get_future()"
                         "       # always the default group\n"
                         "    return future.then(lambda done: done.value()[0].to(buffer.dtype)"
                         ".div_(dist.get_world_size()))\n",
                         "the average over all 3 ranks, not over the 2 ranks of the group DDP handed your hook"),
    "none_group.py": (HEADER + "    buffer = bucket.buffer()\n    compressed = buffer.to(torch.bfloat16)\n"
                      "    future = dist.all_reduce(compressed, group=process_group, async_op=True).get_future()\n"
                      "    return future.then(lambda done: done.value()[0].to(buffer.dtype)"
                      ".div_(process_group.size()))\n",
                      "raised AttributeError: 'NoneType' object has no attribute 'size' at none_group.py:9"),
    "per_gradient.py": (HEADER + f"    {GROUP}\n    buffer = bucket.buffer()\n"
                        "    for grad in bucket.gradients():     # views into the bucket\n"
                        "        half = grad.to(torch.bfloat16)\n        dist.all_reduce(half, group=group)\n"
                        "        grad.copy_(half).div_(group.size())\n    future = torch.futures.Future()\n"
                        "    future.set_result(buffer)\n    return future\n",
                        "issued 6 all-reduce calls for 1 bucket"),
    "view_not_cast.py": (HEADER + f"    {GROUP}\n    buffer = bucket.buffer()\n"
                         "    compressed = buffer.view(torch.bfloat16)   # reinterprets the bits instead of casting\n"
                         "    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()\n"
                         "    return future.then(lambda done: done.value()[0].view(buffer.dtype)"
                         ".div_(group.size()))\n",
                         "handed 4 bytes per gradient value"),
    "torchs_own.py": ("from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import "
                      "fp16_compress_hook\n\n\ndef compress_hook(process_group, bucket):\n"
                      "    return fp16_compress_hook(process_group, bucket)\n",
                      "let torch's own hook issue the all-reduce (default_hooks.py (_compress_hook)"),
}


def mutate(changes: list[tuple[str, str]]) -> str:
    source = SOLUTION
    for old, new in changes:
        assert old in source, old
        source = source.replace(old, new)
    return source


def starting_code() -> str:
    return next("".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"]
                if "".join(c["source"]).startswith("%%writefile my_compress_hook.py")).split("\n", 1)[1]


def check_all(tmp_path: Path, files: dict[str, str]) -> dict[str, str]:
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    return check_hooks([tmp_path / name for name in files])


def test_the_check_passes_right_hooks_and_names_each_learners_mistake(tmp_path):
    """One 3-rank launch: right hooks of several designs pass; each mistake a learner makes is named."""
    files = {name: mutate(changes) for name, changes in RIGHT.items()}
    files.update({name: mutate(changes) for name, (changes, _) in WRONG.items()})
    files["my_compress_hook.py"] = starting_code()
    lines = check_all(tmp_path, files)
    for name in RIGHT:
        assert lines[name].startswith("Correct: ") and "not WORLD (2 ranks and 1 rank)" in lines[name], lines[name]
    for name, (_, words) in WRONG.items():
        assert lines[name].startswith("Not yet: rank ") and words in lines[name], (name, lines[name])
    # the notebook's starting code: float32, and the average over every rank whatever the group; both named
    assert "handed 4 bytes per gradient value" in lines["my_compress_hook.py"], lines["my_compress_hook.py"]
    assert ("And in step 0 on a process group of 2 ranks that is not WORLD, DDP's gradients are (a multiple of) the "
            "average over all 3 ranks, not over the 2 ranks of the group DDP handed your hook"
            in lines["my_compress_hook.py"]), lines["my_compress_hook.py"]
    assert "And" not in lines["sends_float32.py"]  # float32 alone: nothing else to name


def test_the_check_names_each_mistake_a_fresh_reader_made(tmp_path):
    """A second launch: the reader's hooks verbatim. Two passed on 2 ranks on the default group (a 2 written down,
    the default group ignoring DDP's), torch's own hook passed as the learner's work; now each gets its Not yet."""
    files = {**READER_RIGHT, **{name: source for name, (source, _) in READER_WRONG.items()}}
    lines = check_all(tmp_path, files)
    assert lines["avg_op.py"].startswith("Correct: "), lines["avg_op.py"]
    for name, (_, words) in READER_WRONG.items():
        assert lines[name].startswith("Not yet: rank ") and words in lines[name], (name, lines[name])


def test_a_crash_names_the_rank_and_the_learners_line(tmp_path, capsys):
    crash = tmp_path / "crash.py"
    crash.write_text(mutate([("    buffer = bucket.buffer()\n", "    buffer = bucket.buffer()\n    typo_here\n")]))
    assert not check_hook(crash)
    out = capsys.readouterr().out
    assert "inside torch's DDP on 3 ranks" in out
    assert re.search(r"Not yet: the check of crash\.py crashed on rank \d at crash\.py:\d+", out), out
    assert "NameError: name 'typo_here' is not defined" in out


@pytest.fixture(scope="module")
def hooks():
    return launch(WORKERS / "faster_hooks.py", nproc=2, echo=False, timeout=300,
                  args=["--steps", "4", "--rounds", "5"]).results


def test_the_hooks_worker_counts_every_hook(hooks):
    """Small: 4 steps. Every hook's bytes equal the formula on both ranks; the controls send what their twins send."""
    table = hooks_table(hooks)
    assert all(row["counted"] == row["formula"] and row["same_on_every_rank"] for row in table.values()), table
    assert table["PowerSGD r=1"]["calls"] == 3 and table["fp16"]["calls"] == 1
    assert table["PowerSGD r=4, no feedback"]["counted"] == table["PowerSGD r=4"]["counted"]


def test_the_hooks_worker_ends_cleanly_a_second_time():
    """A process group left to die on one of gloo's threads aborted the worker at exit now and then
    (helpers.kit.faster_step.release): a second launch."""
    run = launch(WORKERS / "faster_hooks.py", nproc=2, echo=False, timeout=300, args=["--steps", "3", "--rounds", "5"])
    assert sorted(run.results) == [0, 1]


def test_the_notebooks_hook_functions_run_on_the_workers_results(hooks):
    assert len(hooks_figure(hooks)) == 3
    timed = hook_timings(hooks)
    assert sorted(timed) == sorted(name for name in hooks[0]["record"] if "no feedback" not in name)
    assert all(timing.ranks == 2 for timing in timed.values())
    per_step = powersgd_values_per_step(hooks)
    table = hooks_table(hooks)
    assert all(abs(4 * per_step[name] - table[name]["counted"]) < 1e-6 for name in per_step)


@pytest.fixture(scope="module")
def profiled():
    return launch(WORKERS / "faster_profile.py", nproc=2, echo=False, timeout=300).results[0]


def test_the_trace_file_gives_lesson_03s_issue_order_and_the_bytes_sent(profiled):
    """From the exported Chrome trace: 4 all-reduces issued with most of the backward to run, 1 only after the last
    op, the fp16 hook issued at the same op as DDP's own all-reduce; the trace's own record of each all-reduce's
    tensor gives 4 bytes per parameter, 2 with the fp16 hook."""
    table = profile_table(profiled)
    four, one, half = table["4 buckets"], table["1 bucket"], table["4 buckets, fp16 hook"]
    assert all(o["issued"] == 4 and o["share_after_first_issue"] > 0.5 for o in four["order"] + half["order"])
    assert all(o["issued"] == 1 and o["ops_after_first_issue"] == 0 for o in one["order"])
    assert [o["ops_after_first_issue"] for o in half["order"]] == [o["ops_after_first_issue"] for o in four["order"]]
    parameters = sum(p.numel() for p in mlp(256, 14).parameters())
    assert four["bytes"] == one["bytes"] == [4 * parameters] * 3 and half["bytes"] == [2 * parameters] * 3
    assert not set(four["running_threads"]) & set(four["backward_threads"])
    assert len(timeline_figure(profiled, step=1).get_yticklabels()) == 6


@pytest.fixture(scope="module")
def compiled():
    """The compile worker with a compiler that does not exist (CXX): inductor is skipped with our sentence, the graph
    splits and compiled autograd run (aot_eager needs no compiler). Fresh interpreters: inductor reads CXX when its
    config is imported, and workers forked from the launch server inherit the server's config."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CXX", "no-such-c++-compiler-lesson13")
        return launch(WORKERS / "faster_compile.py", nproc=2, echo=False, timeout=300, fresh=True).results


def test_the_compile_worker_says_what_to_do_without_a_compiler_and_counts_graphs(compiled, capsys):
    skipped = compiled[0]["inductor"]["skipped"]
    assert skipped.startswith(NO_COMPILER.split("{detail}")[0]) and "no-such-c++-compiler-lesson13" in skipped
    counts = [len(split["graphs"]) for split in compiled[0]["splits"].values()]
    assert counts == [3, 2, 2] and compiled[0]["first_bucket_rule"]["cause"] == "AssertionError"
    assert compiled[0]["compiled_autograd"]["graphs_per_step"] == [2, 0, 0]
    print_split_table(compiled[0])
    assert "DDPOptimizer used bucket cap 1048576 and created 3 buckets" in capsys.readouterr().out
    assert len(split_figure(compiled[0]).get_yticklabels()) == 3


@pytest.fixture(scope="module")
def fsdp():
    return launch(WORKERS / "faster_fsdp.py", nproc=2, echo=False, timeout=300).results


def test_fsdp2_compiled_four_ways_sends_what_eager_sends(fsdp, capsys):
    runs = fsdp[0]["runs"]
    assert list(runs) == ["eager", "each block compiled", "each block, fullgraph=True", "whole model compiled"]
    assert all(run["max_difference"] == 0 for got in fsdp.values() for run in got["runs"].values())
    head = sum(4 * p.numel() for p in build_model(512, 3).head.parameters())
    for how in list(runs)[1:]:  # two graphs (blocks 2 and 3 share one), no collective and no head in any of them
        assert len(runs[how]["graphs"]) == 2 and all(not g["collectives"] for g in runs[how]["graphs"])
        assert head not in [g["parameter_bytes"] for g in runs[how]["graphs"]]
    whole = runs["whole model compiled"]["dynamo"]
    assert "graph break in loop" in whole["reasons"]
    assert whole["skipped_frames"][0].startswith("forward (faster_step.py")
    fsdp_table(fsdp[0])
    assert "each block, fullgraph=True" in capsys.readouterr().out


def test_a_launch_leaves_no_compile_cache_behind(fsdp, compiled):
    """The lesson says the compile caches go at the end: the launch server's workers end with os._exit, which runs
    no atexit handler, so the workers remove them themselves (both launches: the server's and fresh interpreters)."""
    caches = {got["cache"] for run in (fsdp, compiled) for got in run.values()}
    assert len(caches) == 2 and all(os.path.basename(c).startswith("lesson13-compile-cache-") for c in caches)
    assert not [c for c in caches if os.path.exists(c)]


@pytest.fixture(scope="module")
def mfu():
    return launch(WORKERS / "faster_mfu.py", nproc=2, echo=False, timeout=300).results


def test_the_fraction_of_a_measured_matmul_rate(mfu):
    result = fraction_table(mfu)
    assert result["flops"] == sum(flops_formula(mfu[0]["layers"], mfu[0]["per_rank_batch"]).values())
    low, high = result["fraction_range"]
    assert 0 < low <= result["fraction"] <= high
    assert all(rate["low"] <= rate["median"] <= rate["high"] for rate in result["rates"].values())
    assert "CPU time of 2 ranks together" in result["verdicts"]["cpu"].sentence


def test_the_closing_note_reads_every_run(hooks, compiled, fsdp, profiled, mfu, capsys):
    closing_note(hooks, compiled, fsdp, profiled, mfu)
    out = capsys.readouterr().out
    assert "Inductor: skipped (no C++ compiler)." in out and "(4 buckets)" in out and "of a measured matmul rate" in out
    assert "(CPU of 2 ranks)" in out
    closing_note(hooks, compiled, fsdp, None, mfu)  # section 5 skipped on CUDA
    assert "trace file" not in capsys.readouterr().out
