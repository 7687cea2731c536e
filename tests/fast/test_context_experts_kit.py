"""Lesson 12 without launches: the kit's attention blocks, merge, simulations, capacity and reference MoE against
torch in one process; the merge exercise's check on wrong merges a learner would write; the pictures draw."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers.kit.context_experts import (
    MISTAKES,
    block_attention,
    block_attention_backward,
    block_pairs,
    build_moe,
    capacity,
    capacity_keep,
    expected_work,
    layout,
    merge_reference,
    positions,
    reference_moe,
    route,
    simulated_ring,
    switch_aux_loss,
)
from helpers.lessons.context_experts import check_merge

RING = Path(__file__).resolve().parents[2] / "helpers" / "workers" / "context_ring_solution.py"


def qkv(seq: int = 16, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, seq, 8, generator=generator) for _ in range(3)]


def test_block_attention_is_sdpa_and_gives_the_log_sum_exp():
    q, k, v = qkv()
    for diagonal in (False, True):
        out, lse = block_attention(q, k, v, diagonal)
        assert torch.allclose(out, F.scaled_dot_product_attention(q, k, v, is_causal=diagonal), atol=1e-6)
        scores = q @ k.transpose(-2, -1) / math.sqrt(8)
        if diagonal:
            scores = scores.masked_fill(torch.ones(16, 16, dtype=torch.bool).triu(1), float("-inf"))
        assert torch.allclose(lse, torch.logsumexp(scores, -1), atol=1e-6)


def test_block_backward_shares_add_up_to_autograds_gradient():
    q, k, v = (t.requires_grad_() for t in qkv())
    grad = torch.randn(1, 2, 16, 8)
    F.scaled_dot_product_attention(q, k, v).backward(grad)
    out, lse = block_attention(q.detach(), k.detach(), v.detach())
    halves = [(slice(0, 7), ), (slice(7, 16), )]  # two blocks of keys, shares computed from the final out and lse
    dq = torch.zeros_like(q)
    for (keys,) in halves:
        share = block_attention_backward(q.detach(), k.detach()[:, :, keys], v.detach()[:, :, keys], out, lse, grad)
        dq += share[0]
        assert torch.allclose(share[1], k.grad[:, :, keys], atol=1e-5)
        assert torch.allclose(share[2], v.grad[:, :, keys], atol=1e-5)
    assert torch.allclose(dq, q.grad, atol=1e-5)


def test_merge_reference_and_the_simulated_ring_equal_attention_over_everything():
    q, k, v = qkv(32)
    merged = merge_reference(*block_attention(q, k[:, :, :10], v[:, :, :10]),
                             *block_attention(q, k[:, :, 10:], v[:, :, 10:]))
    assert torch.allclose(merged[0], F.scaled_dot_product_attention(q, k, v), atol=1e-6)
    for kind in ("contiguous", "balanced"):
        chunks = layout(kind, 4)
        n = sum(len(row) for row in chunks)
        for causal in (False, True):
            outputs = simulated_ring(q, k, v, chunks, causal)
            truth = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            for rank, out in enumerate(outputs):
                assert torch.allclose(out, truth[:, :, positions(chunks[rank], 32, n)], atol=1e-6), (kind, causal)
            wrong = [simulated_ring(q, k, v, chunks, causal, mistake) for mistake in MISTAKES]
            if causal:  # each simulated mistake really is wrong somewhere (it names something a check can see)
                assert all(not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(w, outputs, strict=True))
                           for w in wrong)


def test_layouts_and_the_work_they_give_each_rank():
    assert layout("balanced", 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert [w["blocks"] for w in expected_work(layout("contiguous", 4), causal=True)] == [1, 2, 3, 4]
    assert [w["blocks"] for w in expected_work(layout("balanced", 4), causal=True)] == [9, 9, 9, 9]
    assert [w["blocks"] for w in expected_work(layout("contiguous", 4), causal=False)] == [4, 4, 4, 4]
    assert list(block_pairs([3], [2, 3, 4], causal=True)) == [(0, 0, False), (0, 1, True)]
    with pytest.raises(ValueError, match="layout must be one of"):
        layout("zigzag", 2)


def test_capacity_keeps_first_choices_first_and_earlier_tokens_first():
    chosen = torch.tensor([[0, 1], [0, 2], [1, 0], [0, 3]])  # expert 0: first choice of tokens 0, 1, 3, second of 2
    kept = capacity_keep(chosen, 4, limit=2)
    assert kept.tolist() == [[True, True], [True, True], [True, False], [False, True]]
    assert capacity(16, 4, 1.0) == 8 and capacity(16, 4, 1.25) == 10


def test_reference_moe_equals_a_token_by_token_layer_and_drops_what_capacity_drops():
    router, experts = build_moe()
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(1))
    (out,), (kept,) = reference_moe([x], router, experts)
    chosen, weights, _ = route(x, router)
    assert torch.allclose(weights.sum(-1), torch.ones(16)) and kept.all()
    for t in range(16):
        want = sum(weights[t, s] * experts[int(chosen[t, s])](x[t]) for s in range(2))
        assert torch.allclose(out[t], want, atol=1e-6)
    (_,), (limited,) = reference_moe([x], router, experts, capacity_factor=0.5)
    assert limited.sum() < kept.sum()
    assert switch_aux_loss(torch.full((8, 4), 0.25), torch.tensor([[0, 1], [2, 3]] * 4), 4) == pytest.approx(1.0)


def test_the_pictures_draw(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    from helpers.lessons.context_experts import blocks_figure, merge_figure, ring_figure, saved_figure

    for figure in (ring_figure(4), blocks_figure(4), merge_figure(),
                   saved_figure({"seq": [256, 512, 1024], "fused": [1, 2, 4], "math": [1, 4, 16]})):
        figure.savefig(tmp_path / "figure.png")


MERGE_MUTANTS = {
    "averages the outputs": ("return (out + block_out) / 2, torch.logaddexp(lse, block_lse)", "plain average"),
    "adds the outputs": ("return out + block_out, torch.logaddexp(lse, block_lse)", "sum of the two outputs"),
    "exp without subtracting the maximum": (
        "first, second = torch.exp(lse).unsqueeze(-1), torch.exp(block_lse).unsqueeze(-1)\n"
        "    return (first * out + second * block_out) / (first + second), torch.log(first + second).squeeze(-1)",
        "overflows float32"),
    "weights not normalised": (
        "top = torch.maximum(lse, block_lse)\n"
        "    return (torch.exp(lse - top).unsqueeze(-1) * out + torch.exp(block_lse - top).unsqueeze(-1) * block_out, "
        "torch.logaddexp(lse, block_lse))", "do not add up to 1"),
    "new lse is the larger one": (
        "new_lse = torch.logaddexp(lse, block_lse)\n"
        "    return (torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * "
        "block_out, torch.maximum(lse, block_lse))", "the new lse is the larger of the two"),
    "keeps the old lse": (
        "new_lse = torch.logaddexp(lse, block_lse)\n"
        "    return (torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * "
        "block_out, lse)", "returned one block's lse unchanged"),
    "keeps the newest block (the starting code)": ("return block_out, block_lse", "it equals one block's output"),
}


@pytest.mark.parametrize("name", sorted(MERGE_MUTANTS))
def test_merge_check_names_each_mistake(name, tmp_path, capsys):
    body, message = MERGE_MUTANTS[name]
    path = tmp_path / "merge.py"
    path.write_text(f"import torch\n\n\ndef merge(out, lse, block_out, block_lse):\n    {body}\n")
    assert not check_merge(path)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and message in out, out


def test_merge_check_accepts_the_solution_and_torchs_sigmoid_form(tmp_path, capsys):
    sigmoid = tmp_path / "sigmoid.py"  # torch's form of the same rule (_attention.py, _SDPAMerger._merge_one)
    sigmoid.write_text("import torch.nn.functional as F\n\n\ndef merge(out, lse, block_out, block_lse):\n"
                       "    out = out - F.sigmoid(block_lse - lse).unsqueeze(-1) * (out - block_out)\n"
                       "    return out, lse - F.logsigmoid(lse - block_lse)\n")
    assert check_merge(RING)
    assert check_merge(sigmoid)
    assert all(line.startswith("Correct: ") for line in capsys.readouterr().out.splitlines())


