"""Lessons 10 (meshes) and 11 (beyond your laptop) without a launch: the exercises' messages (wrong answers a learner
would write, each told its mistake and never the answer; right-but-different answers pass), the planner's data-parallel
bytes against FSDP2's own collectives, the optimizer all-reduces' fix, the step-time analysis on made-up rounds, and
each lesson's main line and hand-out."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from helpers.kit.timing import NOT_DISTINGUISHABLE, Timing
from helpers.lessons.mesh import judge_plan, layout_gaps, source_of
from helpers.lessons.scale import (
    check_tp_counts_without_sp,
    dp_traffic,
    fsdp_dp_traffic,
    plan,
    step_time_analysis,
    tp_step_counts,
)

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = {10: ROOT / "notebooks" / "10_meshes.ipynb", 11: ROOT / "notebooks" / "11_at_scale.ipynb"}


# --- lesson 10, exercise 1: the gated MLP's plan, judged from a worker's report ---------------------------------

def report(**changes) -> dict:
    good = {"weights": {"w1": {"placements": ["Shard(dim=0)"], "local_shape": [128, 64]},
                        "w3": {"placements": ["Shard(dim=0)"], "local_shape": [128, 64]},
                        "w2": {"placements": ["Shard(dim=1)"], "local_shape": [64, 128]}},
            "collectives": {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 2}},
            "output_shape": [2, 32, 64], "expected_shape": [2, 32, 64], "output_diff": 3e-7, "grad_diff": 0.0}
    return {**good, **changes}


WHOLE = {"placements": [], "local_shape": [256, 64]}


@pytest.mark.parametrize("changes, words", [
    ({"error": "RuntimeError: Sharding propagation failed for aten.mm.default"}, "follow x from layer to layer"),
    # w3 left out of the plan: its whole output meets w1's half in the product
    ({"error": "RuntimeError: The size of tensor a (128) must match the size of tensor b (256) at non-singleton "
               "dimension 2"}, "element by element"),
    ({"weights": {"w1": WHOLE, "w3": WHOLE, "w2": {"placements": ["Shard(dim=1)"], "local_shape": [64, 128]}}},
     "w1, w3 are whole"),
    ({"output_shape": [2, 16, 64]}, "every rank should end with the whole output"),
    ({"output_diff": 0.3}, "differ from one process's"),
    # gathered between the layers: right numbers, more collectives
    ({"collectives": {"forward": {"all_gather_into_tensor": 2, "all_reduce": 1}, "backward": {"all_reduce": 2}}},
     "right numbers, but"),
    # the input's gradient left as per-rank terms (no backward all-reduce): wrong inside a model
    ({"collectives": {"forward": {"all_reduce": 1}, "backward": {}}}, "right numbers, but"),
    ({"grad_diff": float("inf")}, "of the input"),  # the plan cut the input off from backward
])
def test_judge_plan_says_what_is_wrong_without_naming_the_answer(changes, words, capsys):
    assert not judge_plan(report(**changes))
    out = capsys.readouterr().out
    assert words in out and out.startswith("Not yet: "), out
    for answer in ("Shard(dim=0)", "Shard(0)", "ColwiseParallel", "RowwiseParallel", "column-wise then row-wise"):
        assert answer not in out, out  # a Not yet names the mistake, not the plan


def test_judge_plan_passes_both_right_plans_and_says_what_backward_ran(capsys):
    assert judge_plan(report())  # w1 and w3 each all-reduce their input's gradient
    assert "Backward ran two all-reduces" in capsys.readouterr().out
    # right but different: the block's input made one DTensor, so backward sums both terms before one all-reduce
    assert judge_plan(report(collectives={"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}}))
    assert "Backward runs one all-reduce too" in capsys.readouterr().out


# --- lesson 11, the exercise: tp collectives without sequence parallelism, forward and backward ------------------

def solution(blocks):
    return {"forward": {"all_reduce": 2 * blocks + 1, "all_gather": 1}, "backward": {"all_reduce": 4 * blocks + 1}}


@pytest.mark.parametrize("wrong, message", [
    (lambda b: {"forward": {"all_reduce": 0, "all_gather": 0}, "backward": {"all_reduce": 0}},  # the starting code
     "your forward has no all_gather"),
    (lambda b: {"forward": solution(b)["forward"], "backward": {}}, "your backward has no all_reduce"),  # forward only
    # wq, wk and wv counted as one backward all-reduce
    (lambda b: {"forward": solution(b)["forward"], "backward": {"all_reduce": 2 * b + 1}},
     "per block, your backward count of all_reduce is too low"),
    (lambda b: {"forward": {"all_reduce": 2 * b + 1}, "backward": solution(b)["backward"]},  # the logits' gather
     "your forward has no all_gather"),
    (lambda b: {"forward": {"all_reduce": 2 * b, "all_gather": 1}, "backward": solution(b)["backward"]},  # embedding
     "part outside the blocks is too low"),
    (lambda b: {"forward": solution(b)["forward"], "backward": {"all_reduce": 4 * b}},  # the output layer's backward
     "part outside the blocks is too low"),
    (lambda b: {"forward": {"all_reduce": 6 * b + 2, "all_gather": 1}, "backward": {}},  # the whole step as forward
     "per block, your forward count of all_reduce is too high"),
    (lambda b: {"forward": {"all_gather": 2 * b + 2, "reduce_scatter": 2 * b + 1},  # the sequence-parallel counts
                "backward": {"all_gather": 2 * b + 1, "reduce_scatter": 2 * b + 1, "all_reduce": 2 * b + 1}},
     "per block, your forward count of all_gather is too high"),
    (lambda b: solution(b) if b < 3 else {"forward": {"all_reduce": 9, "all_gather": 1},  # not linear in the blocks
                                           "backward": solution(b)["backward"]},
     "does not grow by the same amount"),
    (lambda b: {"all_reduce": 6 * b + 2, "all_gather": 1}, "should return {'forward'"),  # no phases
    (lambda b: 1 / 0, "raised ZeroDivisionError"),
])
def test_tp_exercise_names_the_mistake_not_torchs_counts(wrong, message, capsys):
    assert not check_tp_counts_without_sp(wrong)
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: ") and message in out, out
    assert not re.search(r"'\w+': \d", out) or "should return" in out, out  # no count of torch's in the message


@pytest.mark.parametrize("right", [
    solution,
    # right but written otherwise: zero counts listed, float counts, other key order
    lambda b: {"backward": {"all_reduce": 4.0 * b + 1, "reduce_scatter": 0},
               "forward": {"all_gather": 1, "all_reduce": 2 * b + 1}},
])
def test_tp_exercise_passes_right_answers(right, capsys):
    assert check_tp_counts_without_sp(right)
    assert capsys.readouterr().out.splitlines()[-1].startswith("Correct: ")


# --- lesson 11: the planner's data-parallel bytes against FSDP2's own collectives -------------------------------

@pytest.mark.parametrize("setting, reduce_bytes", [
    ({}, 2),
    ({"microbatches": 3, "reduce_dtype": torch.float32}, 4),
    ({"microbatches": 3, "reduce_dtype": torch.float32, "reduce_every_microbatch": False}, 4),
    ({"microbatches": 2, "regather": False}, 2),
])
def test_planner_dp_bytes_are_fsdp2s_own(setting, reduce_bytes):
    measured = fsdp_dp_traffic(world_size=4, layers=2, width=32, **setting)
    psi = measured["n_params"]
    m = setting.get("microbatches", 1)
    gathers = m * (2 if setting.get("regather", True) else 1)
    reductions = m if setting.get("reduce_every_microbatch", True) else 1
    # FSDP2 gathers 2 bytes (bf16) per parameter, reduces reduce_dtype's bytes: catches a dtype or a count ignored
    assert measured["bytes"] == {"all_gather": gathers * 2 * psi, "reduce_scatter": reductions * reduce_bytes * psi}
    planned = plan(psi, 4, microbatches=m, reduce_bytes=reduce_bytes, regather=setting.get("regather", True),
                   reduce_every_microbatch=setting.get("reduce_every_microbatch", True))
    assert planned["traffic"]["dp"] == pytest.approx(3 / 4 * sum(measured["bytes"].values()), rel=1e-12)


def test_dp_traffic_keeps_the_one_micro_batch_numbers_and_counts_each_stage():
    psi, ring = 1e9, 0.5
    assert dp_traffic(psi, 2, "DP") == ring * 2 * 2 * psi  # an all-reduce of bf16 gradients
    assert dp_traffic(psi, 2, "ZeRO-1") == dp_traffic(psi, 2, "ZeRO-2") == ring * (2 + 2) * psi
    assert dp_traffic(psi, 2, "ZeRO-3") == ring * 3 * 2 * psi  # the paper's 1.5x of an all-reduce
    assert dp_traffic(psi, 2, "ZeRO-3", microbatches=4) == 4 * dp_traffic(psi, 2, "ZeRO-3")
    assert dp_traffic(psi, 2, "DP", microbatches=4, reduce_every_microbatch=False) == dp_traffic(psi, 2, "DP")
    assert dp_traffic(psi, 2, "DP", reduce_bytes=4) == 2 * dp_traffic(psi, 2, "DP")
    counts = plan(7.5e9, 8, microbatches=4, blocks=2)["counts"]["dp"]
    assert counts == {"all_gather": 4 * 5, "reduce_scatter": 4 * 3}  # per micro-batch, as FSDP2 runs them


def test_replicating_partial_gradients_once_removes_the_optimizers_all_reduces():
    plain, fixed = tp_step_counts(2), tp_step_counts(2, replicate_grads=True)
    assert plain["optimizer"] == {"all_reduce": 15} and "all_reduce" not in plain["forward+backward"]
    assert fixed == {"forward+backward": {**plain["forward+backward"], "all_reduce": 5}, "optimizer": {}}


# --- lesson 11: the step-time analysis on made-up rounds ---------------------------------------------------------

def made_up_rounds(step_ms: dict[str, list[float]], sweep_scale: list[float]) -> dict[int, dict]:
    """One rank's results as scale_step_time.py hands them back, with chosen times (seconds)."""
    sizes = [4096 * 4**k for k in range(7)]
    timings = {f"all_reduce {s}": Timing(f"all_reduce {s}", [(2e-4 + s / 1e9) * f] * 5, [1e-4] * 5)
               for s, f in zip(sizes, sweep_scale, strict=True)}
    timings |= {"matmul": Timing("matmul", [1e-3] * 5, [1e-3] * 5), "adam full": Timing("adam full", [4e-3] * 5),
                "adam shard": Timing("adam shard", [2e-3] * 5)}
    timings |= {f"step {mode}": Timing(f"step {mode}", [t / 1e3 for t in times], [t / 1e3 for t in times])
                for mode, times in step_ms.items()}
    return {0: {"timings": {name: t.as_dict() for name, t in timings.items()}, "sizes": sizes, "n_params": 1000,
                "tensors": 6, "width": 8, "layers": 3, "batch": 4, "world_size": 2}}


def test_step_time_analysis_refuses_a_fit_with_large_residuals_and_reads_increments_round_by_round():
    steps = {"local": [100, 101, 102, 103, 104], "ddp": [110, 111, 112, 113, 114],
             "fsdp_alone": [100, 140, 102, 103, 104], "fsdp": [120, 121, 122, 123, 124]}
    on_the_line = step_time_analysis(made_up_rounds(steps, [1.0] * 7))
    assert on_the_line["fit_used"] and max(abs(r - 1) for r in on_the_line["ratios"]) < 1e-9
    assert on_the_line["verdicts"]["ddp"].faster == "step local"  # spreads 100-104 and 110-114 do not overlap
    assert on_the_line["increments"]["ddp"] == pytest.approx({"median": 0.010, "low": 0.010, "high": 0.010})
    # one slow round of fsdp_alone: the spreads overlap, and the protocol says so
    assert NOT_DISTINGUISHABLE in on_the_line["verdicts"]["fsdp_alone"].sentence
    noisy = step_time_analysis(made_up_rounds(steps, [1.0, 1.6, 0.7, 1.0, 1.0, 1.0, 1.0]))
    assert not noisy["fit_used"]  # residuals of 0.7-1.6: the fit may not predict


# --- lesson 10's helpers -------------------------------------------------------------------------------------------

def test_layout_gaps_reads_losses_gradients_and_rows_per_dp_index():
    ranks = {rank: {"fsdp_tp": {"dp_index": rank // 2, "losses": [1.0, 0.5], "grad_gap": 1e-9 * rank,
                                "local_losses": [1.0 + rank // 2, 0.5], "rows_step0": [[rank // 2]]}}
             for rank in range(4)}
    gaps = layout_gaps(ranks, ["fsdp_tp"], [1.0, 0.5 + 1e-7])["fsdp_tp"]
    assert gaps["loss"] == pytest.approx(1e-7) and gaps["gradient"] == pytest.approx(3e-9)
    assert gaps["same dp"] == 0.0 and gaps["other dp"] == 1.0 and gaps["rows"] == [[0], [1]]
    assert gaps["same rows within dp"]
    ranks[1]["fsdp_tp"]["rows_step0"] = [[7]]  # a tp rank fed other rows
    assert not layout_gaps(ranks, ["fsdp_tp"], [1.0, 0.5])["fsdp_tp"]["same rows within dp"]


def test_source_of_reads_a_function_without_importing_its_file():
    text = source_of(ROOT / "helpers" / "workers" / "mesh_checkpoint.py", "load")
    assert text.startswith("def load(") and "dcp.load" in text
    with pytest.raises(ValueError, match="no top-level function"):
        source_of(ROOT / "helpers" / "workers" / "mesh_checkpoint.py", "nothing")


# --- both lessons: the main line and the hand-out ------------------------------------------------------------------

def _main_line(notebook: dict) -> str:
    text = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"<details>.*?</details>", "", text, flags=re.DOTALL)


@pytest.mark.parametrize("lesson", [10, 11])
def test_the_lesson_keeps_its_main_line_short_and_its_citations_folded(lesson):
    notebook = json.loads(NOTEBOOKS[lesson].read_text())
    main = _main_line(notebook)
    assert len(main.split()) <= 3500, len(main.split())
    citations = re.findall(r"[\w/]+\.(?:py|cpp|h)(?::\d+|`?,? lines? \d+)", main)
    assert len(citations) <= 3, citations
    everything = json.dumps(notebook)
    for absent in ("tests/", "docs/facilitator", "facilitator.md", "SEED-CLAIMS", "stored run", "4 December",
                   "the solution's in this copy"):
        assert absent not in everything, absent  # a student copy has none of these
    for cell in notebook["cells"]:  # no listing over 40 lines in the main line, in a code cell or in its output
        assert cell["cell_type"] == "markdown" or len("".join(cell["source"]).splitlines()) <= 40
        for output in cell.get("outputs", []):
            listing = "".join(output.get("data", {}).get("text/plain", []))
            if listing.startswith(("def ", '"""')):
                assert len(listing.splitlines()) <= 40, listing[:80]
