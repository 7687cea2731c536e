"""Lesson 09's grader, without a launch: the search for tensors a class keeps, the prefetch rule read from event
orders (ours, one waited at once, torch's FSDP2 default), the crash and hang messages, and the lesson's main line."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from helpers.kit.zero import ACCUMULATE_STEP, hidden_storage, other_tensors, padded_flat, reachable_tensors, shard_size
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
    assert "padded with zeros first (padded_flat)" in text and text.endswith("runs/RUN/rank<N>.log.")


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


def test_hidden_storage_finds_the_padded_copy_behind_a_shard_view_and_nothing_behind_a_clone():
    weight = torch.arange(35.0)
    view = padded_flat(weight, 2).chunk(2)[1]  # rank 1's shard, a view of the 36-value padded copy
    found = hidden_storage([("the shard of 0.weight", view)], 2)
    assert found == {"what": "the shard of 0.weight", "bytes": 144, "used": 72}  # would be None if views were skipped
    assert hidden_storage([("the shard of 0.weight", view.clone())], 2) is None


def test_hidden_storage_accepts_views_that_cover_their_storage_and_padding_left_over():
    bucket = torch.zeros(10)
    grads = [("the gradient of a", bucket[:4]), ("the gradient of b", bucket[4:9])]  # 1 value unused: padding
    assert hidden_storage(grads, 2) is None
    assert hidden_storage(grads[:1], 2) == {"what": "the gradient of a", "bytes": 40, "used": 16}


def test_a_held_output_is_nan_until_its_wait_and_then_holds_the_result():
    import torch.distributed as dist

    from helpers.kit.zero import CommLog

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    log = CommLog().install()
    try:
        log.hold_outputs = True
        out, shard = torch.zeros(3), torch.tensor([1.0, 2.0, 3.0])
        work = dist.all_gather_single(out, shard, async_op=True)
        early = out.clone()
        work.wait()
        assert torch.isnan(early).all() and out.tolist() == [1.0, 2.0, 3.0]  # catches a held output never delivered
        total = torch.tensor([4.0])
        work = dist.all_reduce(total, async_op=True)
        assert torch.isnan(total).all()
        work.get_future().wait()
        assert total.tolist() == [4.0]  # delivered through get_future() too
        parts, summed = [torch.zeros(3)], torch.zeros(3)  # the list forms: each tensor of the list is held
        works = [dist.all_gather(parts, shard, async_op=True), dist.reduce_scatter(summed, [shard], async_op=True)]
        early = [parts[0].clone(), summed.clone()]
        for work in works:
            work.wait()
        assert all(torch.isnan(t).all() for t in early) and parts[0].tolist() == summed.tolist() == [1.0, 2.0, 3.0]
        own = shard.clone()  # in place: the output is the input here, so it keeps its values (the collective reads it)
        work = dist.all_gather_single(own, own[:], async_op=True)
        assert own.tolist() == [1.0, 2.0, 3.0]
        work.wait()
        assert own.tolist() == [1.0, 2.0, 3.0]
        blocking = torch.zeros(3)
        dist.all_gather_single(blocking, shard)  # not async: never held
        assert blocking.tolist() == [1.0, 2.0, 3.0]
        log.hold_outputs = False
        free = torch.zeros(3)
        dist.all_gather_single(free, shard, async_op=True).wait()
        assert free.tolist() == [1.0, 2.0, 3.0] and [e["op"] for e in log.events if e["op"] != "wait"] == [
            "all_gather_single", "all_reduce", "all_gather", "reduce_scatter", "all_gather_single",
            "all_gather_single", "all_gather_single"]
    finally:
        log.uninstall()
        dist.destroy_process_group()


def _grad(diff: float, ratio: float, fit: float = 0.0) -> dict:
    return {"diff": diff, "scale": 1.0, "ratio": ratio, "fit": fit, "numel": 4}


def test_a_gradient_averaged_twice_is_named_and_a_scale_that_does_not_fit_is_not():
    text = zero._gradient_message("zero2", "0.weight", _grad(0.3, 0.5), 0, 0, 2, 8)
    assert "is 1/2 of DDP's averaged gradient: it was divided by the world size twice" in text, text
    text = zero._gradient_message("zero2", "0.weight", _grad(0.3, 2.0, fit=0.2), 0, 0, 2, 8)
    assert "times" not in text and "it differs by up to 0.3" in text, text  # a ratio of 2 alone is not "2 times"


def test_nan_in_a_gradient_says_read_before_wait_only_when_the_step_was_async():
    nan = _grad(float("nan"), float("nan"), float("nan"))
    text = zero._gradient_message("bucketed", "0.weight", nan, 0, 0, 2, 8, asynchronous=True)
    assert text.startswith("after step 0's backward the gradient of 0.weight holds NaN: this check keeps the output")
    assert "wait() for a bucket's all-reduce before you divide and copy it" in text, text
    text = zero._gradient_message("zero1", "0.weight", nan, 0, 0, 2, 8, asynchronous=False)
    assert "none of this step's collectives was async" in text and "wait()" not in text, text


def test_wrong_parameters_say_where_their_values_came_from():
    row = {"params": 0.5, "placed": {"0.weight": {"offset": 1, "padded": 36}}}
    assert "0.weight holds values [1, 36) of DDP's updated 0.weight gathered and padded to 36 values, where the " \
           "parameter is the first 35, [0, 35)" in zero._params_message("zero1", row, 0, {"0.weight": 35})
    row["placed"] = {"0.weight": {"before": True}}
    assert "0.weight still holds its values from before this step's update" in zero._params_message(
        "zero1", row, 2, {"0.weight": 35})


def test_a_crash_at_the_harness_line_is_not_blamed_on_it_and_a_freed_parameter_is_explained():
    error = WorkerFailed("...", rank=1, exitcode=1, run=RUN, where="zero_check.py:75 (in train)",
                         error="RuntimeError: setStorage: sizes [9, 9], strides [1, 9], storage offset 0, and itemsize "
                               "4 requiring a storage size of 324 are out of bounds for storage of size 0")
    text = crash_message(error, "the zero3 check of my_zero3.py")
    assert text.startswith("the zero3 check of my_zero3.py crashed on rank 1 at zero_check.py:75 (in train), the "
                           "check's own line: torch raised this while it ran the model with your class's hooks in it, "
                           "so no line of your file was running: RuntimeError: setStorage"), text
    assert "What it means: a parameter whose storage free_storage had emptied (0 bytes) was used" in text, text


def test_the_harness_stop_says_what_the_class_did_in_place_of_its_own_line():
    error = WorkerFailed("...", rank=0, exitcode=1, run=RUN, where="zero_check.py:101 (in look)",
                         error="StoppedByTheCheck: model 'tied', step 0: unit 1's forward was about to run with "
                               "a.weight freed (0 bytes of storage)")
    text = crash_message(error, "the zero3 check of my_zero3.py")
    assert text.startswith("the zero3 check of my_zero3.py crashed on rank 0: the check stopped your class: model "
                           "'tied', step 0: unit 1's forward"), text
    assert "zero_check.py" not in text, text
