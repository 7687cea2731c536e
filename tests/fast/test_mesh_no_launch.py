"""Lesson 10's helpers without a launch: the collective plan and its counts, the tokens, the reference run, the plan
judge, checkpoint chunks."""

import pytest
import torch

from helpers.kit import transformer
from helpers.lessons.mesh import (
    agrees_with_commdebugmode,
    checkpoint_chunks,
    expected_counts,
    judge_plan,
    measured_counts,
    not_sharded_by_rows,
)


def report(**changes) -> dict:
    good = {"weights": {"w1": {"placements": ["Shard(dim=0)"], "local_shape": [128, 64]},
                        "w2": {"placements": ["Shard(dim=1)"], "local_shape": [64, 128]}},
            "collectives": {"forward": {"all_reduce": 1}, "backward": {"all_reduce": 1}},
            "output_shape": [2, 32, 64], "expected_shape": [2, 32, 64], "output_diff": 3e-7, "grad_diff": 0.0}
    return {0: {**good, **changes}}


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


@pytest.mark.parametrize("changes, words", [
    ({"error": "RuntimeError: Sharding propagation failed for aten.mm.default"},
     "RowwiseParallel an input split along its features"),
    ({"weights": {"w1": {"placements": [], "local_shape": [256, 64]},
                  "w2": {"placements": ["Shard(dim=1)"], "local_shape": [64, 128]}}}, "whole on every rank"),
    ({"output_shape": [2, 16, 64]}, "every rank should end with the whole output"),
    ({"output_diff": 0.3}, "differ from one process's"),
    ({"collectives": {"forward": {"all_gather_into_tensor": 1, "all_reduce": 1}, "backward": {"all_reduce": 1}}},
     "right answer, but"),
    # the input's gradient left as per-rank terms (no backward all-reduce): wrong inside a model
    ({"collectives": {"forward": {"all_reduce": 1}, "backward": {}}}, "one in backward"),
    ({"grad_diff": float("inf")}, "of the input"),  # the plan cut the input off from backward
])


def test_judge_plan_says_what_is_wrong(changes, words, capsys):
    assert not judge_plan(report(**changes))
    assert words in capsys.readouterr().out
    assert judge_plan(report())


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
