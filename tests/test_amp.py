"""Tests of helpers/amp.py and the AMP worker scripts (lesson 04), at the smallest useful size."""
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from helpers import WORKERS, launch
from helpers.amp import (
    bytes_per_parameter,
    check_amp_train_step,
    format_facts,
    layer_dtypes,
    op_dtypes,
    parameter_casts,
    underflow_fraction,
)
from helpers.models import SimpleModel


def test_format_facts_match_ieee_and_bf16() -> None:
    facts = format_facts()
    assert facts["fp16"]["largest"] == 65504
    assert facts["fp16"]["smallest subnormal"] == 2.0 ** -24
    assert facts["bf16"]["smallest normal"] == facts["fp32"]["smallest normal"]
    assert facts["bf16"]["epsilon (gap after 1.0)"] == 2.0 ** -7


def test_scaling_rescues_values_that_underflow_in_fp16() -> None:
    values = torch.tensor([1e-9, 1e-8, 1e-3])
    assert abs(underflow_fraction(values) - 2 / 3) < 1e-6
    assert underflow_fraction(values, scale=2.0 ** 16) == 0
    assert underflow_fraction(values, torch.bfloat16) == 0


def test_autocast_lowers_layers_and_keeps_losses_fp32() -> None:
    seen = layer_dtypes(SimpleModel(), torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,)))
    assert [dtype for name, _, dtype in seen if name.startswith("fc")] == ["torch.bfloat16"] * 3
    assert seen[-1] == ("loss", "cross_entropy", "torch.float32")
    assert op_dtypes()["cross_entropy"] == "torch.float32"


def _step(model, optimizer, scaler, images, labels, max_norm, unscale_first=True):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def test_check_accepts_the_right_step_and_catches_clipping_before_unscale(capsys) -> None:
    assert check_amp_train_step(_step)
    assert not check_amp_train_step(lambda *a: _step(*a, unscale_first=False))
    assert "unscale_" in capsys.readouterr().out


def test_scaler_worker_skips_the_spike_and_backs_off() -> None:
    run = launch(WORKERS / "amp_scaler.py", nproc=1, echo=False,
                 args=["--steps", "6", "--growth-interval", "2", "--spike-step", "4"])
    scales = [s for _, s in sorted(run.metric("scale"))]
    assert scales == [1024, 1024, 2048, 2048, 4096, 2048]
    assert run.results[0]["skipped"] == [4]


def test_ddp_worker_ranks_skip_together_and_resume_the_scale(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "amp.pt")
    run = launch(WORKERS / "amp_ddp.py", nproc=2, echo=False,
                 args=["--steps", "4", "--spike-step", "1", "--spike-rank", "1", "--save", checkpoint])
    assert run.results[0]["skipped"] == run.results[1]["skipped"] == [1]
    assert run.metric("scale", rank=0) == run.metric("scale", rank=1)
    assert run.results[0]["checksum"] == run.results[1]["checksum"]
    resumed = launch(WORKERS / "amp_ddp.py", nproc=2, echo=False, args=["--steps", "1", "--resume", checkpoint])
    assert resumed.results[0]["start_scale"] == resumed.results[1]["start_scale"] == run.results[0]["final_scale"]


def test_train_worker_runs_bf16_and_reports() -> None:
    run = launch(WORKERS / "amp_train.py", nproc=1, echo=False,
                 args=["--precision", "bf16", "--model", "simple", "--steps", "4", "--per-rank-batch", "8"])
    result = run.results[0]
    assert result["precision"] == "bf16" and 0 <= result["accuracy"] <= 1 and result["ms_per_step"] > 0


def test_scaler_worker_clips_the_true_gradients_to_max_norm() -> None:
    run = launch(WORKERS / "amp_scaler.py", nproc=1, echo=False,
                 args=["--steps", "6", "--spike-step", "99", "--max-norm", "0.01"])
    for row in run.metrics:  # every gradient norm here is above 0.01, so every step is clipped to it
        assert row["grad_norm"] > 0.01 and abs(row["clipped_norm"] - 0.01) < 1e-4


def test_autocast_leaves_ddp_traffic_at_fp32_and_bf16_compress_hook_halves_it() -> None:
    run = launch(WORKERS / "amp_ddp_traffic.py", nproc=2, echo=False, args=["--steps", "2"])
    modes = run.results[0]["modes"]
    parameters = modes["fp32"]["parameters"]
    assert modes["fp32"]["bytes_per_step"] == modes["bf16 autocast"]["bytes_per_step"] == 4 * parameters
    assert modes["bf16 autocast + bf16_compress_hook"]["bytes_per_step"] == 2 * parameters
    assert modes["bf16 autocast + bf16_compress_hook"]["dtypes_sent"] == ["bfloat16"]


def test_bytes_per_parameter_with_adam_under_autocast() -> None:
    model = SimpleModel()
    optimizer = torch.optim.Adam(model.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(torch.rand(4, 1, 28, 28)), torch.randint(0, 10, (4,)))
    loss.backward()
    optimizer.step()
    assert bytes_per_parameter(model, optimizer) == {"weights": 4, "gradients": 4, "optimizer state": 8}


def test_autocast_casts_each_parameter_once_per_context() -> None:
    assert parameter_casts(contexts=1, passes_per_context=3) == 2
    assert parameter_casts(contexts=3, passes_per_context=1) == 6
