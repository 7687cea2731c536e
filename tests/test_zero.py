"""Lesson 09's grader: every wrong class a learner would write hears a "Not yet" that names its mistake, every right
class passes, the untouched starting code says "Not yet", and a crash names its rank and line.

The classes are in tests/zero_classes.py. All of them that do not crash are graded in ONE launch (check_many: the
worker checks each class in turn beside one shared run of torch's DDP), so the file costs a few launches, not one per
class; test_a_single_check_prints_what_the_batch_decides shows that a class checked alone hears the same words.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from zero_classes import CRASHING, RIGHT, SOLUTION, WRONG

from helpers.lessons.zero import check_many, check_step

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOK = ROOT / "notebooks" / "09_build_zero.ipynb"
STAGES = ("bucketed", "zero1", "zero2", "zero3")


def _starting_code(folder: Path) -> dict[str, str]:
    """The notebook's %%writefile cells, written into `folder`: file name -> stage."""
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    stages = {"my_bucketed_ddp.py": "bucketed", "my_zero1.py": "zero1", "my_zero2.py": "zero2", "my_zero3.py": "zero3"}
    written = {}
    for source in cells:
        match = re.match(r"%%writefile (\S+)\n", source)
        if match:
            (folder / match[1]).write_text(source[match.end():])
            written[match[1]] = stages[match[1]]
    assert written == stages
    return written


def _learner_files(folder: Path) -> None:
    """The solution's four classes, split into the four files a learner fills in (my_zero2.py imports Zero1 from
    my_zero1.py beside it, my_zero3.py Zero2 from my_zero2.py)."""
    import ast

    source = SOLUTION.read_text()
    classes = {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef)}
    header = ("import torch\nimport torch.distributed as dist\nfrom torch import nn\n\n"
              "from helpers.kit.zero import alloc_storage, free_storage, padded_flat\n")
    files = {"my_bucketed_ddp.py": ("", "BucketedDDP"), "my_zero1.py": ("", "Zero1"),
             "my_zero2.py": ("from my_zero1 import Zero1\n", "Zero2"),
             "my_zero3.py": ("from my_zero2 import Zero2\n", "Zero3")}
    for name, (imports, cls) in files.items():
        (folder / name).write_text(header + imports + "\n\n" + classes[cls] + "\n")


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    """Every class that does not crash, graded in one 2-rank launch: name -> Checked."""
    folder = tmp_path_factory.mktemp("classes")
    checks, names = [], []
    for index, (name, (stage, source, *_)) in enumerate({**WRONG, **RIGHT}.items()):
        path = folder / f"class_{index:02d}.py"
        path.write_text(source)
        checks.append((stage, path))
        names.append(name)
    starting, learner = folder / "starting", folder / "learner"
    starting.mkdir()
    learner.mkdir()
    for file, stage in _starting_code(starting).items():
        checks.append((stage, starting / file))
        names.append(f"starting code, {stage}")
    _learner_files(learner)
    for file, stage in zip(("my_bucketed_ddp.py", "my_zero1.py", "my_zero2.py", "my_zero3.py"), STAGES, strict=True):
        checks.append((stage, learner / file))
        names.append(f"a learner's four files, {stage}")
    return dict(zip(names, check_many(checks, timeout=600), strict=True))


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_class_hears_what_its_mistake_is(name, verdicts):
    _, _, message = WRONG[name]
    got = verdicts[name]
    parts = message if isinstance(message, tuple) else (message,)
    assert not got and got.message.startswith("Not yet: rank ") and all(part in got.message for part in parts), \
        got.message


@pytest.mark.parametrize("name", list(RIGHT))
def test_a_right_class_passes(name, verdicts):
    got = verdicts[name]
    assert got and got.message.startswith(f"Correct: {RIGHT[name][0]} equals DDP + AdamW"), got.message


def test_the_notebooks_starting_code_says_not_yet(verdicts):
    said = {stage: verdicts[f"starting code, {stage}"].message for stage in STAGES}
    assert all(message.startswith("Not yet: ") for message in said.values()), said
    assert "the bucket plan" in said["bucketed"]  # the per-parameter all-reduce trains right but breaks the plan
    for stage in ("zero1", "zero2", "zero3"):  # plain data parallelism: right values, nothing sharded
        assert "`shards` should map every parameter" in said[stage], said[stage]


def test_a_learner_who_fills_in_the_four_files_passes(verdicts):
    for stage in STAGES:
        assert verdicts[f"a learner's four files, {stage}"], verdicts[f"a learner's four files, {stage}"].message


def test_parameters_alone_miss_a_sum_not_averaged_on_odd_and_tied(verdicts):
    # why the check compares the gradients (LL-1): AdamW's m / sqrt(v) cancels a constant gradient scale, so after
    # 5 steps a Zero1 that sums without dividing is within 1e-6 of DDP's parameters on odd and tied
    checked = verdicts["zero1: no division by the world size (LL-1)"]
    for got in checked.results.values():
        diffs = {name: model["max_diff"] for name, model in got["models"].items()}
        assert diffs["odd"] < 1e-6 and diffs["tied"] < 1e-6 < diffs["mlp"], diffs


def test_the_check_reads_waits_and_grouped_calls(verdicts):
    # the solution's zero3 waits for each unit's all-gathers once that unit starts; c11 gathers a unit in one call
    events = verdicts["the solution, zero3"].results[0]["models"]["mlp"]["impl"]["steps"][1]
    calls = {e["id"]: e for e in events if e["op"] not in ("mark", "wait")}
    waited = [e["id"] for e in events if e["op"] == "wait"]
    assert sorted(waited) == sorted(i for i, e in calls.items() if e["async"]) and len(waited) == 12
    grouped = verdicts["c11 zero3: one all-gather per unit, FSDP2's grouping"].results[0]["models"]["mlp"]
    assert sum(1 for e in grouped["impl"]["steps"][1] if e["op"] == "all_gather_single") == 6


def test_a_single_check_prints_what_the_batch_decides(verdicts, tmp_path, capsys):
    name = "m14 zero3: the prefetch is waited for at once"
    path = tmp_path / "alone.py"
    path.write_text(WRONG[name][1])
    assert not check_step("zero3", path)
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == verdicts[name].message, (lines, verdicts[name].message)
    assert lines[-2].startswith("Running alone.py on 2 ranks"), lines  # said at once, before the launch


@pytest.mark.parametrize("name", list(CRASHING))
def test_a_crash_names_the_rank_the_line_and_what_it_means(name, tmp_path, capsys):
    stage, source, message = CRASHING[name]
    path = tmp_path / "crashing.py"
    path.write_text(source)
    assert not check_step(stage, path)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith(f"Not yet: the {stage} check of crashing.py crashed on rank "), out
    assert message in out and "Each rank's output and traceback are in " in out, out
