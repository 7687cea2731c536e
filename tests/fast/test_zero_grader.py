"""Lesson 09's grader, without a launch: the search for tensors a class keeps, the prefetch rule read from event
orders (ours, one waited at once, torch's FSDP2 default), the crash and hang messages, and the lesson's main line."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from helpers.kit.zero import ACCUMULATE_STEP, other_tensors, padded_flat, reachable_tensors, shard_size
from helpers.launcher.api import LaunchTimeout, Run, WorkerFailed
from helpers.lessons import zero
from helpers.lessons.zero import crash_message, expected, traffic

NOTEBOOK = Path(__file__).resolve().parents[2] / "notebooks" / "09_build_zero.ipynb"
RUN = Run(script="zero_check.py", nproc=2, log_dir=Path("runs/RUN"))


class Keeper:
    cache: ClassVar[dict] = {}  # a class attribute: the classic place a learner's buffers hide

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.shards = {p: torch.zeros(2) for p in model.parameters()}


def test_the_search_finds_class_attributes_closures_and_tensor_attributes_with_their_path():
    model = nn.Linear(3, 2)
    keeper = Keeper(model)
    Keeper.cache[model.weight] = torch.ones(7)
    kept = torch.ones(5)
    keeper.hook = lambda: kept  # a closure
    model.bias._full = torch.ones(11)  # a buffer hung on a parameter
    try:
        found = {path: tuple(t.shape) for t, path in reachable_tensors(Keeper=keeper, model=model)}
    finally:
        Keeper.cache.clear()
    assert found["Keeper.cache[<tensor>]"] == (7,)  # would be missing if class attributes were skipped (m15)
    assert found["Keeper.hook (closure of test_the_search_finds_class_attributes_closures_and_tensor_attributes_"
                 "with_their_path.<locals>.<lambda>: kept)"] == (5,)
    assert found["Keeper.model.bias._full"] == (11,) and found["Keeper.model.weight"] == (2, 3)  # the first path


def test_other_tensors_skips_what_the_class_may_hold_and_names_the_largest_left():
    model = nn.Linear(3, 2)
    keeper = Keeper(model)
    keeper.kept = {"a": torch.ones(4), "b": torch.ones(9)}
    known = [*model.parameters(), *keeper.shards.values()]
    found = other_tensors(known, Keeper=keeper, model=model)
    assert found == {"tensors": 2, "bytes": 52, "largest": [9], "where": "Keeper.kept['b']"}


def test_hook_dicts_are_searched_but_their_counter_keys_are_not_shown():
    model = nn.Linear(3, 2)
    buffer = torch.ones(6)
    model.register_forward_hook(lambda *_: buffer.sum())
    paths = [path for t, path in reachable_tensors(model=model) if t is buffer]
    assert paths and paths[0].startswith("model._forward_hooks[<hook>] (closure of "), paths


def units_of(*sizes: tuple[int, ...]) -> list[list[int]]:
    return [list(unit) for unit in sizes]


UNITS = units_of((4, 2), (4, 2), (2,))  # three units; on 2 ranks every tensor divides
BYTES = [4 * sum(unit) for unit in UNITS]  # 24, 24, 8


def gather(call: int, nbytes: int) -> dict:
    return {"op": "all_gather_single", "bytes": nbytes, "async": True, "id": call}


def mark(label: str, held: int = 0) -> dict:
    return {"op": "mark", "label": label, "held": held}


def wait(call: int) -> dict:
    return {"op": "wait", "id": call}


def ours(wait_prefetch_at_once: bool = False) -> list[dict]:
    """One step of a Zero3 that prefetches as the lesson asks (or waits for each prefetch at once)."""
    early = [wait(2)] if wait_prefetch_at_once else []
    late = [] if wait_prefetch_at_once else [wait(2)]
    return [gather(1, BYTES[0]), gather(2, BYTES[1]), wait(1), *early, mark("forward start 0"),
            mark("forward end 0"), gather(3, BYTES[2]), *late, mark("forward start 1"), mark("forward end 1"),
            wait(3), mark("forward start 2"), mark("forward end 2"), gather(4, BYTES[2]), gather(5, BYTES[1]),
            wait(4), mark("backward start 2"), gather(6, BYTES[0]), wait(5), mark("backward start 1"), wait(6),
            mark("backward start 0"), mark("backward end")]


def test_the_prefetch_rule_passes_ours_and_fails_a_prefetch_waited_at_once():
    assert zero._prefetch_problem(ours(), UNITS, 2) is None
    problem = zero._prefetch_problem(ours(wait_prefetch_at_once=True), UNITS, 2)
    assert problem.startswith("unit 1's all-gather was issued before unit 0 computed, and waited for before unit 0 "
                              "computed too"), problem


def test_the_prefetch_rule_is_a_cpu_rule_that_fsdp2s_gpu_default_fails():
    # FSDP2's default order (no explicit forward prefetch, blocking all-gathers): overlaps on GPUs, not on gloo
    fsdp = [gather(1, BYTES[0]), mark("forward start 0"), mark("forward end 0"), gather(2, BYTES[1]),
            mark("forward start 1"), mark("forward end 1"), gather(3, BYTES[2]), mark("forward start 2")]
    problem = zero._prefetch_problem(fsdp, UNITS, 2)
    assert problem.startswith("unit 1's all-gather was not issued by the start of unit 0's forward. On a CPU backend")


def test_traffic_counts_an_all_reduce_twice_and_skips_markers_and_waits():
    events = [{"op": "all_reduce", "bytes": 100, "async": True, "id": 1}, wait(1), mark("backward end"),
              {"op": "reduce_scatter_single", "bytes": 100, "async": False, "id": 2},
              {"op": "all_gather_single", "bytes": 100, "async": False, "id": 3}]
    counts = traffic(events)
    assert counts["volume"] == 400 and counts["all_reduce calls"] == 1 and "wait calls" not in counts


def test_shard_arithmetic():
    assert [shard_size(n, 2) for n in (35, 5, 15, 4426)] == [18, 3, 8, 2213]
    flat = padded_flat(torch.arange(5.0), 2)
    assert flat.tolist() == [0, 1, 2, 3, 4, 0] and flat.chunk(2)[1].tolist() == [3, 4, 0]
    assert expected([35, 5, 15], 2) == {"params": 55, "shard": 29, "padding": 3, "adam_shard_bytes": 232,
                                        "grad_shard_bytes": 116, "param_shard_bytes": 116}
    assert 0 < ACCUMULATE_STEP < 4  # steps before it are single passes, and the last one is too (the tables read it)


def test_a_gloo_size_check_says_to_pad():
    error = WorkerFailed("...", rank=1, exitcode=1, run=RUN, where="my_zero1.py:22 (in step)",
                         error="RuntimeError: [rank1]:[F1206 ProcessGroupGloo.cpp:1583] Check failed: outputShape[0] * "
                               "worldSize == inputShape[0] (34 vs. 35)")
    text = crash_message(error, "the zero1 check of my_zero1.py")
    assert text.startswith("the zero1 check of my_zero1.py crashed on rank 1 at my_zero1.py:22 (in step): "), text
    assert "What it means: gloo checks that a reduce-scatter's input holds exactly world_size times" in text
    assert "padded with zeros first (padded_flat)" in text and text.endswith("(rank<N>.log).")


def test_a_hang_says_where_each_rank_waited(monkeypatch, tmp_path, capsys):
    def hangs(*args, **kwargs):
        raise LaunchTimeout("timed out", run=RUN, where={0: "waiting in dist.all_reduce at my_zero1.py:9",
                                                         1: "in time.sleep at my_zero1.py:11"})

    monkeypatch.setattr(zero, "launch", hangs)
    monkeypatch.setattr(zero, "launch_server_pid", lambda: 1)
    path = tmp_path / "my_zero1.py"
    path.write_text("")
    assert not zero.check_step("zero1", path, timeout=5)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("Running my_zero1.py on 2 ranks"), out
    assert out[1] == "Not yet: the zero1 check of my_zero1.py did not finish; where each rank was:", out
    assert out[2:4] == ["  rank 0: waiting in dist.all_reduce at my_zero1.py:9", "  rank 1: in time.sleep at "
                        "my_zero1.py:11. Each rank's output and traceback are in runs/RUN/rank<N>.log. A collective "
                        "that only some ranks call waits for the others until the timeout (is one inside "
                        "`if rank == 0:`?)."], out


def test_a_missing_file_says_so_without_a_launch(tmp_path, capsys):
    assert not zero.check_step("zero2", tmp_path / "my_zero2.py")
    assert "my_zero2.py does not exist yet: run the %%writefile cell above it first." in capsys.readouterr().out


def _main_line(notebook: dict) -> str:
    text = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"<details>.*?</details>", "", text, flags=re.DOTALL)


def test_the_lesson_keeps_its_main_line_short_and_its_citations_folded():
    notebook = json.loads(NOTEBOOK.read_text())
    main = _main_line(notebook)
    words = len(re.findall(r"[\w'’.-]+", re.sub(r"[|#*`]", " ", main)))
    citations = re.findall(r"\.(?:py|hpp|h|cpp):\d", main)
    assert words <= 3500 and len(citations) <= 3, (words, citations)
    everything = json.dumps(notebook)
    for absent in ("../tests/", "tests/test_", "../docs/", "facilitator", "the solution's in this copy",
                   "--impl solution", "solutions' in the teacher's copy"):
        assert absent not in everything, absent  # a student copy has none of these
    for cell in notebook["cells"]:  # no listing over 40 lines in the main line
        assert cell["cell_type"] == "markdown" or len("".join(cell["source"]).splitlines()) <= 40


def test_a_segfault_points_at_a_copy_into_freed_storage():
    error = WorkerFailed("...", rank=0, exitcode=-11, run=RUN, where="my_zero3.py:36 (in _gather)",
                         error="Fatal Python error: Segmentation fault")
    text = crash_message(error, "the zero3 check of my_zero3.py")
    assert "at my_zero3.py:36 (in _gather) (exit code -11: killed by a signal" in text, text
    assert "What it means: the process touched memory it does not own; in this lesson that is usually a copy into a " \
           "parameter whose storage free_storage emptied: call alloc_storage(p) before copying in." in text, text
