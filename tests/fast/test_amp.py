"""Lesson 04's library (helpers/lessons/amp.py) and the exercise's check. The AMP workers are launched, and asserted,
by the lesson (notebooks/04_amp.ipynb, under pytest --nbval); here only plain functions, without launches."""
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from helpers.kit.models import SimpleModel
from helpers.lessons.amp import (
    bytes_per_parameter,
    cast_bytes_alive,
    cast_names_alive,
    check_amp_train_step,
    cpu_16bit_support,
    cuda_fp32_ops,
    format_facts,
    index_copy_without_autocast,
    layer_dtypes,
    mismatch_after_autocast,
    onednn_convolutions,
    op_dtypes,
    overflows_under_autocast,
    parameter_bytes_at_end_of_forward,
    parameter_casts,
    saved_tensor_bytes,
    sums_of_ones,
    underflow_fraction,
)


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


def _step(model, optimizer, scaler, images, labels, max_norm, unscale_first=True, dtype=torch.float16, clip=True):
    with torch.autocast("cpu", dtype=dtype):
        loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    if unscale_first:
        scaler.unscale_(optimizer)
    if clip:
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def test_check_accepts_the_right_step_and_catches_clipping_before_unscale(capsys) -> None:
    assert check_amp_train_step(_step)
    assert not check_amp_train_step(lambda *a: _step(*a, unscale_first=False))
    assert "unscale_" in capsys.readouterr().out


def test_check_names_bf16_instead_of_fp16_and_gives_no_scaler_hints(capsys) -> None:
    # a learner who wrote dtype=torch.bfloat16 and otherwise the right step: bf16 does not overflow where fp16
    # does, so a check that only compared scales and skipped steps would blame scaler.update / scaler.step
    assert not check_amp_train_step(lambda *a: _step(*a, dtype=torch.bfloat16))
    out = capsys.readouterr().out
    assert "torch.bfloat16" in out and "float16" in out
    assert "scaler.update()" not in out and "use scaler.step" not in out and "unscale_" not in out


def test_check_says_clipping_is_missing_not_misplaced(capsys) -> None:
    assert not check_amp_train_step(lambda *a: _step(*a, clip=False))
    out = capsys.readouterr().out
    assert "clip_grad_norm_ was not called" in out and "ran before" not in out


def test_check_sees_clipping_however_it_was_imported(capsys) -> None:
    from torch.nn.utils import clip_grad_norm_

    def step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    assert check_amp_train_step(step)
    assert not check_amp_train_step(lambda *a: _step(*a, unscale_first=False))
    assert "ran before scaler.unscale_" in capsys.readouterr().out


def test_check_gives_no_clipping_hint_when_autocast_is_missing(capsys) -> None:
    def fp32_step(model, optimizer, scaler, images, labels, max_norm):  # the exercise's starting code
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        return loss.item()

    assert not check_amp_train_step(fp32_step)
    out = capsys.readouterr().out
    assert "did not run under torch.autocast" in out and "clip_grad_norm_ ran before" not in out
    # the walkthrough's friction: a scale mismatch and changed weights reported for a step that never used the
    # scaler; the one thing to fix is said instead
    assert "the loss was not scaled (call scaler.scale(loss).backward()" in out
    assert "the scale is" not in out and "weights changed" not in out and "weights differ" not in out, out


def test_cpu_fp16_autocast_keeps_reductions_in_fp16_where_cudas_lists_use_fp32() -> None:
    cpu_fp16 = op_dtypes("cpu", torch.float16)
    assert all(cpu_fp16[op] == "torch.float16" for op in ("exp", "sum", "softmax", "log_softmax", "layer_norm"))
    assert {"exp", "sum", "softmax", "log_softmax", "layer_norm", "mse_loss"} <= cuda_fp32_ops()
    assert "relu" not in cuda_fp32_ops() and "matmul" not in cuda_fp32_ops()  # a parser that read every macro fails
    assert overflows_under_autocast("cpu", torch.float16) == {"sum of 100,000 ones": "float16 inf",
                                                              "exp(12)": "float16 inf"}
    assert overflows_under_autocast("cpu", torch.bfloat16) == {"sum of 100,000 ones": "bfloat16 99840",
                                                               "exp(12)": "bfloat16 162816"}


def test_matmul_accumulates_wider_than_a_running_bf16_total() -> None:
    assert sums_of_ones(4096) == {"matmul kernel": 4096.0, "running total in 16 bits": 256.0}


def test_a_16_bit_activation_after_the_autocast_block_fails_in_an_fp32_layer() -> None:
    assert "same dtype" in mismatch_after_autocast()


def test_cpu_16bit_support_reads_the_flags_together(monkeypatch) -> None:
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", lambda: False)
    without = cpu_16bit_support({"avx2", "avx512f"})
    assert without[0] == "vector and 16-bit instructions of this CPU: ['avx2', 'avx512f']"
    assert "although it lists no bf16 instructions: they convert bf16 to fp32 inside" in without[3]
    assert "in hardware" in cpu_16bit_support({"avx512f", "amx_bf16"})[3]
    assert "no oneDNN fp16 kernels here" in without[4]


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


def test_autocast_parameter_casts_live_until_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    alive = cast_bytes_alive(model, torch.rand(4, 8))
    assert alive["end of forward, inside autocast"] == 2  # a bf16 copy of every parameter, in the cache
    # after the context: only what backward needs (the second weight), not the first weight or the biases
    assert alive["after autocast exits"] == 2 * 64 / sum(p.numel() for p in model.parameters())
    assert alive["after backward"] == 0
    torch.manual_seed(0)
    names = cast_names_alive(model, torch.rand(4, 8))
    assert sorted(names["after autocast exits"]) == ["2.weight"]
    assert names["after backward"] == {}


def test_op_dtypes_separates_autocast_promote_from_type_promotion() -> None:
    dtypes = op_dtypes()
    assert dtypes["mse_loss(lowered, lowered)"] == "torch.float32"  # both inputs bf16: autocast's fp32 list
    low = torch.rand(4, 4).bfloat16()
    assert F.mse_loss(low, low).dtype == torch.bfloat16  # outside autocast the same call stays bf16
    assert dtypes["index_copy(lowered, fp32) (autocast: promote)"] == "torch.float32"
    assert "same dtype" in index_copy_without_autocast()  # the same call outside autocast is refused
    assert dtypes["add lowered + fp32 (ordinary promotion)"] == "torch.float32"


def test_saved_tensor_bytes_halves_the_floating_activations_under_bf16() -> None:
    from helpers.kit.models import SmallCNN

    images, labels = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    torch.manual_seed(0)
    fp32 = saved_tensor_bytes(SmallCNN(), images, labels, None)
    torch.manual_seed(0)
    bf16 = saved_tensor_bytes(SmallCNN(), images, labels, torch.bfloat16)
    assert "16-bit weight casts" not in fp32 and bf16["16-bit weight casts"] > 0
    assert fp32["activations int64"] == bf16["activations int64"]  # max-pool indices and labels: not lowered
    # the loss's log_softmax stays fp32 under autocast; everything else floating is saved in bf16, at half the bytes
    assert bf16["activations bfloat16"] * 2 == fp32["activations float32"] - bf16["activations float32"]


def test_parameter_bytes_at_end_of_forward_depend_on_where_zero_grad_runs() -> None:
    from helpers.kit.models import SmallCNN

    images, labels = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    torch.manual_seed(0)
    before = parameter_bytes_at_end_of_forward(SmallCNN(), images, labels, zero_grad_before_forward=True)
    torch.manual_seed(0)
    after = parameter_bytes_at_end_of_forward(SmallCNN(), images, labels, zero_grad_before_forward=False)
    assert sum(before.values()) == 14 and before["gradients"] == 0
    assert sum(after.values()) == 18 and after["gradients"] == 4
    torch.manual_seed(0)
    kept = parameter_bytes_at_end_of_forward(SmallCNN(), images, labels, zero_grad_before_forward=True,
                                             set_to_none=False)
    assert sum(kept.values()) == 18 and kept["gradients"] == 4  # zeroed in place, still allocated


def test_onednn_convolutions_reads_the_verbose_lines() -> None:
    from helpers.kit.models import SmallCNN

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN: there are no verbose lines to read")
    torch.manual_seed(0)
    rows = onednn_convolutions(SmallCNN(), torch.rand(4, 1, 28, 28), torch.randint(0, 10, (4,)), torch.float32)
    assert {row["pass"] for row in rows} == {"forward_training", "backward_data", "backward_weights"}
    assert all(row["implementation"] and row["ms"] >= 0 for row in rows)


def _mutated_step(mutation):
    """The right step with one near-miss a learner makes, for the check's hints."""
    def step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        if mutation == "plain backward":
            loss.backward()
        else:
            scaler.scale(loss).backward()
        if mutation == "optimizer.step":  # no unscale_, no scaler.step: the weights are stepped directly
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            optimizer.step()
            scaler.update()
            return loss.item()
        scaler.unscale_(optimizer)
        if mutation != "clip after step":
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        if mutation == "unscale_ then optimizer.step":  # raises nothing: unscale_ recorded the inf checks
            optimizer.step()
        else:
            scaler.step(optimizer)
        if mutation == "clip after step":
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.update()
        return loss.item()
    return step


def test_check_turns_the_scalers_errors_into_hints(capsys) -> None:
    # optimizer.step() in place of scaler.step: torch's "No inf checks were recorded prior to update."
    assert not check_amp_train_step(_mutated_step("optimizer.step"))
    out = capsys.readouterr().out
    assert out.startswith("Not yet") and "scaler.step(optimizer)" in out and "optimizer.step()" in out
    # backward on the plain loss: torch's "Attempted unscale_ but _scale is None"
    assert not check_amp_train_step(_mutated_step("plain backward"))
    out = capsys.readouterr().out
    assert out.startswith("Not yet") and "scaler.scale(loss).backward()" in out


def test_check_names_optimizer_step_after_unscale_not_update_before_step(capsys) -> None:
    """Review r0304-3 04-2: unscale_, clipping, optimizer.step(), scaler.update(): scaler.step never ran, so the
    first hint must say so, and update() must not be blamed for running before a scaler.step that never came."""
    assert not check_amp_train_step(_mutated_step("unscale_ then optimizer.step"))
    out = capsys.readouterr().out
    assert out.startswith("Not yet: scaler.step(optimizer) was never called"), out
    assert "optimizer.step()" in out and "scaler.update() ran before" not in out, out


def test_check_says_clipping_after_the_step_not_before_unscale(capsys) -> None:
    assert not check_amp_train_step(_mutated_step("clip after step"))
    out = capsys.readouterr().out
    assert "ran after scaler.step(optimizer)" in out and "ran before scaler.unscale_" not in out


def test_parameter_bytes_at_end_of_forward_in_plain_fp32() -> None:
    from helpers.kit.models import SmallCNN

    images, labels = torch.rand(8, 1, 28, 28), torch.randint(0, 10, (8,))
    for before, set_to_none, expected in ((True, True, 12), (False, True, 16), (True, False, 16)):
        torch.manual_seed(0)
        held = parameter_bytes_at_end_of_forward(SmallCNN(), images, labels, zero_grad_before_forward=before,
                                                 set_to_none=set_to_none, dtype=torch.float32)
        assert sum(held.values()) == expected and held["16-bit casts of the weights"] == 0  # autocast off: no casts


def test_check_accepts_get_total_norm_then_clip_grads_with_norm(capsys) -> None:
    """Review 04-2: torch's documented equivalent of clip_grad_norm_, in two public calls."""
    def step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        nn.utils.clip_grads_with_norm_(model.parameters(), max_norm, nn.utils.get_total_norm(grads))
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    assert check_amp_train_step(step), capsys.readouterr().out
    assert nn.utils.clip_grads_with_norm_ is torch.nn.utils.clip_grad._clip_grads_with_norm_  # restored


def test_check_names_update_before_step(capsys) -> None:
    """Review 04-2: scaler.update() before scaler.step(): the step unscales a second time; the hint must say so,
    not blame the loss's placement or max_norm."""
    def step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.update()
        scaler.step(optimizer)
        return loss.item()

    assert not check_amp_train_step(step)
    out = capsys.readouterr().out
    assert out.startswith("Not yet") and "scaler.update() ran before scaler.step(optimizer)" in out, out
    assert "compute the loss inside the autocast block" not in out, out


def test_check_refuses_backward_and_step_inside_autocast(capsys) -> None:
    """Review 04-2: the lesson says to wrap only the forward pass and the loss; a step with everything inside the
    autocast block gets the same weights, so the check names it."""
    def step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            scaler.step(optimizer)
            scaler.update()
        return loss.item()

    assert not check_amp_train_step(step)
    out = capsys.readouterr().out
    assert out.startswith("Not yet") and "backward, the clipping, scaler.step ran inside the autocast block" in out, out


def test_check_names_a_typo_and_its_line_instead_of_a_traceback(capsys) -> None:
    """Walkthrough w0304: a typo in the learner's step (scaler.unscale for unscale_, a misspelt name) gets a
    "Not yet" naming the error and the learner's line, as lesson 03's check does, not a raw traceback."""
    def my_train_step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        scaler.update()
        return loss.item()

    assert not check_amp_train_step(my_train_step)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: my_train_step raised AttributeError:") and "'unscale'" in out, out
    assert "(line 6 of your my_train_step: scaler.unscale(optimizer))" in out, out

    def misspelt(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        scaler.scale(los).backward()  # noqa: F821 (the typo under test)
        return loss.item()

    assert not check_amp_train_step(misspelt)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: misspelt raised NameError:"), out
    assert "line 4 of your misspelt: scaler.scale(los).backward()" in out, out
    # GradScaler's own errors still become hints, not "raised" (the scaler's checks keep their meaning)
    assert not check_amp_train_step(_mutated_step("optimizer.step"))
    assert " raised " not in capsys.readouterr().out


def test_check_says_the_scale_was_not_halved_without_update(capsys) -> None:
    """Walkthrough w0304: without scaler.update() the hint gave two bare numbers; it now says what update() does."""
    def step(model, optimizer, scaler, images, labels, max_norm):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        scaler.step(optimizer)
        return loss.item()

    assert not check_amp_train_step(step)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: the scale is") and "it was not halved" in out, out
    assert "(in an overflowing step)" in out and "in a normal step" not in out, out
