"""Lesson 03: the readable DataParallel, the all-reduce counting hook, and the dp_vs_ddp_* workers."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import launch
from helpers.dp import (
    NaiveDataParallel,
    check_reduce,
    data_parallel_step_ms,
    max_abs_diff,
    reduce_gradients,
    single_device_gradients,
)
from helpers.models import SimpleModel

WORKERS = Path(__file__).resolve().parent.parent / "helpers" / "workers"


@pytest.fixture(autouse=True)
def _runs_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.rand(size, 1, 28, 28, generator=generator), torch.randint(0, 10, (size,), generator=generator)


@pytest.mark.parametrize("num_devices,parallel", [(2, True), (3, False), (3, True)])
def test_naive_data_parallel_gradients_equal_single_device(num_devices: int, parallel: bool) -> None:
    images, labels = _batch(10)  # 10 does not divide by 3: uneven chunks, as torch.chunk makes them
    torch.manual_seed(0)
    model = SimpleModel()
    reference = single_device_gradients(model, images, labels, nn.functional.cross_entropy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    report = NaiveDataParallel(model, num_devices, parallel).train_step(
        images, labels, nn.functional.cross_entropy, optimizer)
    assert max_abs_diff([p.grad for p in model.parameters()], reference) < 1e-6
    assert sum(work["samples"] for work in report.per_device) == 10
    assert set(report.phase_seconds) == {"scatter", "replicate", "forward", "gather", "loss", "backward",
                                         "reduce", "step"}


def test_naive_data_parallel_work_and_memory_per_device() -> None:
    images, labels = _batch(8)
    model = SimpleModel()
    optimizer = torch.optim.Adam(model.parameters())
    report = NaiveDataParallel(model, 2).train_step(images, labels, nn.functional.cross_entropy, optimizer)
    first, second = report.per_device
    assert first["grad_norm_before_reduce"] > 0 and second["grad_norm_before_reduce"] > 0
    assert first["optimizer_steps"] == 1 and second["optimizer_steps"] == 0
    assert first["optimizer_state_bytes"] >= 2 * first["param_bytes"] and second["optimizer_state_bytes"] == 0
    assert first["output_bytes"] == 3 * second["output_bytes"]  # its chunk plus the gathered batch


def test_naive_data_parallel_training_matches_single_device_over_steps() -> None:
    images, labels = _batch(12)
    torch.manual_seed(0)
    parallel_model, single_model = SimpleModel(), SimpleModel()
    single_model.load_state_dict(parallel_model.state_dict())
    parallel_opt = torch.optim.SGD(parallel_model.parameters(), lr=0.1, momentum=0.9)
    single_opt = torch.optim.SGD(single_model.parameters(), lr=0.1, momentum=0.9)
    naive = NaiveDataParallel(parallel_model, 2)
    for _ in range(3):
        parallel_opt.zero_grad()
        naive.train_step(images, labels, nn.functional.cross_entropy, parallel_opt)
        single_opt.zero_grad()
        nn.functional.cross_entropy(single_model(images), labels).backward()
        single_opt.step()
    assert max_abs_diff(list(parallel_model.parameters()), list(single_model.parameters())) < 1e-5


def test_check_reduce_accepts_the_reduction_and_rejects_mistakes(capsys) -> None:
    assert check_reduce(reduce_gradients)

    def average_instead(replicas):
        reduce_gradients(replicas)
        for p in replicas[0].parameters():
            p.grad /= len(replicas)

    def not_written(replicas):
        raise NotImplementedError

    assert not check_reduce(average_instead)
    assert not check_reduce(not_written)
    assert capsys.readouterr().out.count("Not yet") == 2


def test_data_parallel_is_a_pass_through_without_gpus() -> None:
    if torch.cuda.is_available():
        pytest.skip("with GPUs DataParallel really splits the batch")
    assert nn.DataParallel(SimpleModel()).device_ids == []
    assert data_parallel_step_ms(SimpleModel(), global_batch=4, repeats=1) > 0


def test_counting_hook_counts_one_call_per_bucket() -> None:
    run = launch(WORKERS / "dp_vs_ddp_buckets.py", nproc=2, args=["--caps", "0.5", "25", "--steps", "1"], echo=False)
    for rank in (0, 1):
        calls = [row["allreduce_calls_per_step"] for row in run.metrics if row["rank"] == rank]
        assert calls == [8, 1]
    assert run.results[0]["cap_25"]["bucket_mb"] == [4.29]
    assert len(run.results[0]["cap_0.5"]["bucket_mb"]) == 8


def test_no_sync_cuts_allreduce_calls_and_keeps_gradients() -> None:
    run = launch(WORKERS / "dp_vs_ddp_no_sync.py", nproc=2, args=["--accumulate", "3", "--micro-batch", "2"], echo=False)
    for rank in (0, 1):
        res = run.results[rank]
        assert (res["calls_every_backward"], res["calls_with_no_sync"]) == (3, 1)
        assert res["diff_every_backward"] < 1e-6 and res["diff_with_no_sync"] < 1e-6


def test_overlap_trace_holds_backward_and_allreduce_on_one_process() -> None:
    run = launch(WORKERS / "dp_vs_ddp_overlap.py", nproc=1, args=["--bucket-cap-mb", "1", "--per-rank-batch", "4"],
                 echo=False)
    events = run.results[0]["events"]
    kinds = {event["kind"] for event in events}
    assert {"backward", "all-reduce issued"} <= kinds
    assert run.results[0]["allreduce_calls"] == 4
    issued = [e["start_us"] for e in events if e["kind"] == "all-reduce issued"]
    backward_end = max(e["end_us"] for e in events if e["kind"] == "backward")
    assert min(issued) < backward_end  # the first bucket is sent while backward still runs


def test_options_worker_measures_bucket_views_and_unused_parameters() -> None:
    run = launch(WORKERS / "dp_vs_ddp_options.py", nproc=2, args=["--steps", "1", "--per-rank-batch", "4"], echo=False)
    for rank in (0, 1):
        res = run.results[rank]
        assert res["default"]["grad_storages"] == res["default"]["parameters"] == 32
        assert res["gradient_as_bucket_view"]["grad_storages"] == 2
        assert res["unused_error"].startswith("Expected to have finished reduction")
