"""Lesson 03's rebuild of DataParallel on the CPU (helpers.kit.dp_vs_ddp), when DDP issues its all-reduces, and the
exercise's check, in this process: no launch."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from helpers.kit.dp_vs_ddp import NaiveDataParallel, replicate, torch_replicate_on_cpu
from helpers.kit.models import SimpleModel
from helpers.kit.tensors import max_abs_diff
from helpers.lessons.dp_vs_ddp import check_traffic, intersect, issue_order, merge, single_device_gradients, subtract


def _batch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return torch.rand(size, 1, 28, 28, generator=generator), torch.randint(0, 10, (size,), generator=generator)


@pytest.mark.parametrize("num_devices,parallel", [(2, True), (3, False), (3, True)])


def test_naive_data_parallel_gradients_equal_single_device(num_devices: int, parallel: bool) -> None:
    images, labels = _batch(10)  # 10 does not divide by 3: uneven chunks, as torch.chunk makes them
    torch.manual_seed(0)
    model = SimpleModel()
    reference = single_device_gradients(model, images, labels, nn.functional.cross_entropy)
    assert all(p.grad is None for p in model.parameters())  # the reference leaves the module untouched
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    report = NaiveDataParallel(model, num_devices, parallel).train_step(
        images, labels, nn.functional.cross_entropy, optimizer)
    assert max_abs_diff([p.grad for p in model.parameters()], reference) < 1e-6
    assert sum(work["samples"] for work in report.per_device) == 10
    assert set(report.phase_seconds) == {"scatter", "replicate", "forward", "gather", "loss", "backward",
                                         "reduce", "step"}


def test_evidence_is_read_from_the_run() -> None:
    images, labels = _batch(8)
    model = SimpleModel()
    weights = len(list(model.parameters()))
    report = NaiveDataParallel(model, 3).train_step(images, labels, nn.functional.cross_entropy,
                                                    torch.optim.Adam(model.parameters()))
    for device, work in enumerate(report.per_device):
        assert work["hook_threads"] == {f"our thread for device {device}"} and work["hooks_fired"] > 0
        assert work["weights_are_leaves"] == work["weights_with_grad"] == work["replica_parameters"] == 0
        assert work["weight_grad_fn"] == "BroadcastBackward"
    first, *others = report.per_device
    assert first["optimizer_holds"] == first["weights_changed_by_step"] == weights
    assert all(w["optimizer_holds"] == w["weights_changed_by_step"] == w["optimizer_state_bytes"] == 0 for w in others)
    assert first["optimizer_state_bytes"] >= 2 * first["weight_bytes"]
    assert (report.reduce["reduce_calls"], report.reduce["devices_summed"]) == (1, 3)
    assert report.reduce["bytes_copied"] == report.reduce["bytes_from_other_devices"] == 2 * first["weight_bytes"]


def test_our_replicate_matches_torchs_own_replicate_run_on_cpu() -> None:
    torch.manual_seed(0)
    model = SimpleModel()
    theirs, (ours, _) = torch_replicate_on_cpu(model, 3), replicate(model, 3)
    images, _ = _batch(4)
    for device in range(3):
        assert torch.equal(theirs[device](images), ours[device](images))
        assert list(theirs[device].parameters()) == [] and not theirs[device].fc1.weight.is_leaf
    shares = [r.fc1.weight.untyped_storage().data_ptr() == model.fc1.weight.untyped_storage().data_ptr()
              for r in theirs]
    assert shares == [True, False, False]
    theirs[2](images).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_naive_data_parallel_training_matches_single_device_over_steps() -> None:
    images, labels = _batch(12)
    torch.manual_seed(0)
    parallel_model, single_model = SimpleModel(), SimpleModel()
    single_model.load_state_dict(parallel_model.state_dict())
    parallel_opt = torch.optim.SGD(parallel_model.parameters(), lr=0.1, momentum=0.9)
    single_opt = torch.optim.SGD(single_model.parameters(), lr=0.1, momentum=0.9)
    naive = NaiveDataParallel(parallel_model, 2, evidence=False)
    for _ in range(3):
        parallel_opt.zero_grad()
        naive.train_step(images, labels, nn.functional.cross_entropy, parallel_opt)
        single_opt.zero_grad()
        nn.functional.cross_entropy(single_model(images), labels).backward()
        single_opt.step()
    assert max_abs_diff(list(parallel_model.parameters()), list(single_model.parameters())) < 1e-5


@pytest.mark.parametrize("right", [
    lambda parameter_bytes, devices: 2 * (devices - 1) * parameter_bytes,
    lambda parameter_bytes, devices: 2.0 * (devices - 1) * parameter_bytes,  # a float, the same number
    lambda parameter_bytes, devices: sum(2 * parameter_bytes for _ in range(1, devices)),  # device by device
])
def test_check_traffic_accepts_right_answers_built_differently(capsys, right) -> None:
    assert check_traffic(right)
    assert capsys.readouterr().out.startswith("Correct: ")


def _not_written(parameter_bytes, devices):
    raise NotImplementedError


def _crashes(parameter_bytes, devices):
    copies = devices - devices
    return parameter_bytes / copies


@pytest.mark.parametrize("wrong, message", [
    (_not_written, "traffic still raises NotImplementedError"),
    (lambda b, n: (n - 1) * b, "only the weights going out; the gradients come back to device 0 too"),
    (lambda b, n: 2 * n * b, "device 0 keeps the module's own weights: nothing is copied to or from it"),
    (lambda b, n: (2 * n - 1) * b, "the weights go out to n - 1 devices, not n"),
    # the ring all-reduce's per-link bytes: equal to the weights alone at 2 devices, so 3 and 4 must be checked too
    (lambda b, n: int(2 * (n - 1) / n * b), "that is what a ring all-reduce puts through each link"),
    (lambda b, n: 2 * (n - 1) * b // 4, "a quarter of the bytes: parameter_bytes is already in bytes"),
    (lambda b, n: 2 * (n - 1) * b * 4, "four times the bytes: parameter_bytes is already in bytes"),
    # right at 2 devices, and equal to the weights alone at 3
    (lambda b, n: 2 * b, "your answer does not change with the number of devices"),
    (lambda b, n: None, "returned None, not a number"),
    (lambda b, n: n * (n - 1) * b, "Count per device: what does each device other than 0 receive"),
    (_crashes, "raised ZeroDivisionError: division by zero (line 3 of your _crashes: return parameter_bytes / copies)"),
])
def test_check_traffic_names_each_mistake(capsys, wrong, message) -> None:
    assert not check_traffic(wrong)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and message in out, out


def test_span_arithmetic() -> None:
    assert merge([(5, 6), (0, 2), (1, 3)]) == [(0, 3), (5, 6)]
    assert intersect([(0, 10)], [(2, 3), (8, 12)]) == [(2, 3), (8, 10)]
    assert subtract([(0, 10)], [(2, 3), (8, 12)]) == [(0, 2), (3, 8)]


def test_issue_order_counts_the_backward_ops_left_after_the_first_issue() -> None:
    events = [{"kind": "backward", "start_us": t, "end_us": t + 1} for t in (0, 2, 4, 6)]
    events += [{"kind": "all-reduce issued", "start_us": 3, "end_us": 3.5},   # after 2 of the 4 ops started
               {"kind": "all-reduce running", "start_us": 3.5, "end_us": 9},
               {"kind": "all-reduce issued", "start_us": 7.5, "end_us": 8}]   # after the last op started
    order = issue_order(events)
    counts = (order["ops"], order["ops_after_first_issue"], order["issued"], order["issued_before_last_op"])
    assert counts == (4, 2, 2, 1)
    assert order["share_after_first_issue"] == 0.5
    last_only = issue_order([e for e in events if e["start_us"] != 3])
    assert last_only["ops_after_first_issue"] == 0 and last_only["issued_before_last_op"] == 0


def test_data_parallel_is_a_pass_through_without_gpus() -> None:
    if torch.cuda.is_available():
        pytest.skip("with GPUs DataParallel really splits the batch")
    model = SimpleModel()
    wrapped = nn.DataParallel(model)
    images, _ = _batch(4)
    assert wrapped.device_ids == [] and torch.equal(wrapped(images), model(images))


def test_naive_data_parallel_builds_its_replicas_with_torchs_replicate(monkeypatch) -> None:
    """The replicate step of our rebuild is torch.nn.parallel.replicate itself (only its device copy is ours)."""
    calls = []
    real = torch.nn.parallel.replicate
    monkeypatch.setattr(torch.nn.parallel, "replicate",
                        lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    images, labels = _batch(6)
    model = SimpleModel()
    NaiveDataParallel(model, 2, evidence=False).train_step(images, labels, nn.functional.cross_entropy,
                                                           torch.optim.SGD(model.parameters(), lr=0.0))
    assert len(calls) == 1 and calls[0][0] is model


def test_batchnorm_running_stats_persist_from_device_0_only() -> None:
    """DataParallel's buffer pitfall (data_parallel.py:81-92), reproduced by torch's replicate in our rebuild:
    the module's running mean afterwards is the one computed from device 0's chunk alone, not the whole batch."""
    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.BatchNorm1d(8), nn.Linear(8, 10))

    model, device_0_only, whole_batch = build(), build(), build()
    images, labels = _batch(8)
    images[4:] += 5.0  # device 1's chunk has other statistics
    NaiveDataParallel(model, 2, evidence=False).train_step(images, labels, nn.functional.cross_entropy,
                                                           torch.optim.SGD(model.parameters(), lr=0.0))
    device_0_only(images[:4])
    whole_batch(images)
    assert torch.allclose(model[2].running_mean, device_0_only[2].running_mean)
    assert not torch.allclose(model[2].running_mean, whole_batch[2].running_mean)
