"""Lesson 10's helpers without a launch: the collective plan and its counts, the tokens, the reference run, the plan
judge (Llama's gated MLP: each wrong report told its mistake, never the plan; both right plans pass), checkpoint chunks,
the layouts' gaps and the listing helper."""

from pathlib import Path

import pytest
import torch

from helpers.kit import transformer
from helpers.lessons.mesh import (
    agrees_with_commdebugmode,
    check_mlp_plan,
    checkpoint_chunks,
    expected_counts,
    judge_plan,
    layout_gaps,
    measured_counts,
    not_sharded_by_rows,
    source_of,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_plan_counts_units_blocks_and_the_root():
    fsdp = expected_counts("fsdp", blocks=2)
    assert fsdp["forward"] == {"dp/all_gather": 3}
    assert fsdp["backward"] == {"dp/all_gather": 2, "dp/reduce_scatter": 3}  # the root is not gathered again
    assert expected_counts("hsdp", blocks=5)["backward"]["replicate/all_reduce"] == 6
    no_sp = expected_counts("fsdp_tp_no_sp", blocks=3)
    assert no_sp["forward"]["tp/all_reduce"] == 7 and no_sp["backward"]["tp/all_reduce"] == 13
    sp = expected_counts("fsdp_tp", blocks=1)
    assert sp["forward"] == {"dp/all_gather": 2, "tp/all_gather": 4, "tp/reduce_scatter": 3}


def test_measured_counts_group_ops_by_dimension_and_check_commdebugmode():
    counts = {phase: {"calls": {}, "bytes": {}, "commdebugmode": {}} for phase in ("forward", "backward", "optimizer")}
    counts["forward"] = {"calls": {"_allgather_base_/dp": 3, "all_gather_into_tensor/tp": 6},
                         "bytes": {"_allgather_base_/dp": 30, "all_gather_into_tensor/tp": 60},
                         "commdebugmode": {"_allgather_base_": 3, "all_gather_into_tensor": 6}}
    assert measured_counts(counts)["forward"] == {"dp/all_gather": 3, "tp/all_gather": 6}
    assert measured_counts(counts, "bytes")["forward"]["tp/all_gather"] == 60
    assert agrees_with_commdebugmode(counts)
    counts["forward"]["commdebugmode"]["all_gather_into_tensor"] = 5  # one collective we did not attribute
    assert not agrees_with_commdebugmode(counts)


def test_batches_and_rows_are_the_same_tokens_in_every_process():
    inputs, targets = transformer.batch(3, 8)
    again, _ = transformer.batch(3, 8)
    assert torch.equal(inputs, again) and not torch.equal(inputs, transformer.batch(4, 8)[0])
    assert torch.equal(inputs[:, 1:], targets[:, :-1])  # targets are the inputs shifted by one token
    assert torch.equal(torch.cat([transformer.rows(inputs, i, 4) for i in range(4)]), inputs)


def test_reference_learns_and_is_deterministic():
    first, second = transformer.reference_losses(5, 8), transformer.reference_losses(5, 8)
    assert first == second and first[-1] < first[0]


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
    # the worker names the layer whose forward was running when torch refused
    ({"error": "RuntimeError: Sharding propagation failed for aten.mm.default", "layer": "w2"},
     "on 2 ranks, in w2's forward: RuntimeError"),
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


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # a one-process save, on purpose


def test_not_sharded_by_rows_rejects_a_replicated_save(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = transformer.Transformer()
    optimizer = transformer.make_optimizer(model)
    transformer.train_step(model, optimizer, *transformer.batch(0, 2))  # creates AdamW's moments
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path / "whole", no_dist=True)
    chunks = checkpoint_chunks(tmp_path / "whole")
    assert len(chunks) == 3 * 19 and all(len(entry["chunks"]) == 1 for entry in chunks.values())
    assert sorted(not_sharded_by_rows(chunks, 4)) == sorted(chunks)  # every whole tensor is caught


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


def test_exercise_check_refuses_a_missing_file_or_a_file_without_plan(tmp_path, capsys):
    assert not check_mlp_plan(tmp_path / "my_mlp_plan.py")
    assert "does not exist yet" in capsys.readouterr().out
    (tmp_path / "my_mlp_plan.py").write_text("plan = {}\n")
    assert not check_mlp_plan(tmp_path / "my_mlp_plan.py")
    assert "must define PLAN" in capsys.readouterr().out
