"""Lesson 10 (meshes): helpers/kit/transformer.py, helpers/lessons/mesh.py and the mesh_* workers, at the smallest
sizes."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import WorkerFailed, launch
from helpers.kit import transformer
from helpers.lessons.mesh import (
    agrees_with_commdebugmode,
    check_mesh_for,
    check_mlp_plan,
    check_mlp_plans,
    checkpoint_chunks,
    checkpoint_files,
    expected_counts,
    load_in_one_process,
    measure_launch,
    measured_counts,
    mesh_groups,
    not_sharded_by_rows,
)

WORKERS = Path(__file__).resolve().parent.parent / "helpers" / "workers"
HEADER = ("from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel\n"
          "from torch.distributed.tensor import Replicate, Shard\n"
          "\n")


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


PLANS = {
    "answer": ('PLAN = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": RowwiseParallel()}',
               "Backward ran two all-reduces"),
    # right but different: the block's input made one DTensor, so backward sums both terms before one all-reduce
    "shared input": ('PLAN = {"": PrepareModuleInput(input_layouts=(Replicate(),), '
                     'desired_input_layouts=(Replicate(),), use_local_output=False), "w1": ColwiseParallel(), '
                     '"w3": ColwiseParallel(), "w2": RowwiseParallel()}', "Backward runs one all-reduce too"),
    "starting code": ("PLAN = {}", "w1, w3, w2 are whole"),
    "no gate": ('PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel()}', "element by element"),
    "gate row-wise": ('PLAN = {"w1": ColwiseParallel(), "w3": RowwiseParallel(), "w2": RowwiseParallel()}',
                      "torch refused the plan"),
    "all column-wise": ('PLAN = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": ColwiseParallel()}',
                        "torch refused the plan"),
    "gathered between": ('PLAN = {"w1": ColwiseParallel(output_layouts=Replicate()), "w3": ColwiseParallel('
                         'output_layouts=Replicate()), "w2": RowwiseParallel(input_layouts=Replicate())}',
                         "right numbers, but"),
    "output split": ('PLAN = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), '
                     '"w2": RowwiseParallel(output_layouts=Shard(1))}', "the whole output"),
}


def test_exercise_check_on_real_launches(tmp_path, capsys):
    files = []
    for name, (plan, _) in PLANS.items():
        files.append(tmp_path / f"{name.replace(' ', '_')}.py")
        files[-1].write_text(HEADER + plan + "\n")
    verdicts = check_mlp_plans(files)  # one launch tries them all, each on a fresh block
    out = capsys.readouterr().out.splitlines()[1:]  # after the announcement
    assert len(out) == len(PLANS), out
    for (name, (_, words)), verdict, line in zip(PLANS.items(), verdicts, out, strict=True):
        assert verdict == line.startswith("Correct: ") == (name in ("answer", "shared input")), (name, line)
        assert words in line, (name, line)


def test_exercise_check_names_the_learners_line_when_the_plan_file_crashes(tmp_path, capsys):
    plan_file = tmp_path / "my_mlp_plan.py"
    plan_file.write_text(HEADER + 'PLAN = {"w1": ColwiseParallel(), "w2": RowwiseParallel(1 / 0)}\n')
    assert not check_mlp_plan(plan_file)
    out = capsys.readouterr().out
    assert "Not yet: the check of my_mlp_plan.py crashed on rank" in out, out
    assert "my_mlp_plan.py:4" in out and "ZeroDivisionError" in out and "rank<N>.log" in out, out


def test_exercise_check_refuses_a_missing_file_or_a_file_without_plan(tmp_path, capsys):
    assert not check_mlp_plan(tmp_path / "my_mlp_plan.py")
    assert "does not exist yet" in capsys.readouterr().out
    (tmp_path / "my_mlp_plan.py").write_text("plan = {}\n")
    assert not check_mlp_plan(tmp_path / "my_mlp_plan.py")
    assert "must define PLAN" in capsys.readouterr().out


def test_layouts_match_one_process_and_the_plan():
    run = launch(WORKERS / "mesh_layouts.py", nproc=4, args=["--steps", 3, "--layouts", "hsdp", "fsdp_tp"], echo=False,
                 timeout=120)
    reference = transformer.reference_losses(3, 8)
    for rank in range(4):
        for layout in ("hsdp", "fsdp_tp"):
            seen = run.results[rank][layout]
            assert max(abs(a - b) for a, b in zip(seen["losses"], reference, strict=True)) < 1e-5
            assert seen["grad_gap"] < 1e-6
            counted = measured_counts(seen["counts"])
            assert counted["forward"] == expected_counts(layout)["forward"]
            assert counted["backward"] == expected_counts(layout)["backward"]
            assert agrees_with_commdebugmode(seen["counts"])
    # As the notebook checks: ranks of one dp index took the same rows, and the dp ranks' rows, joined in dp
    # order, are the global batch (catches data not split, rows overlapping or missing, tp ranks fed other rows).
    for layout in ("hsdp", "fsdp_tp"):
        by_dp = {}
        for rank in range(4):
            by_dp.setdefault(run.results[rank][layout]["dp_index"], []).append(run.results[rank][layout]["rows_step0"])
        assert all(rows == same[0] for same in by_dp.values() for rows in same)
        assert len(by_dp) == {"hsdp": 4, "fsdp_tp": 2}[layout]
        assert [row for index in sorted(by_dp) for row in by_dp[index][0]] == transformer.batch(0, 8)[0].tolist()


def test_workers_refuse_a_world_that_is_not_2_by_2():
    with pytest.raises(WorkerFailed, match="start it with 4 processes"):
        launch(WORKERS / "mesh_tour.py", nproc=2, echo=False, timeout=60)


def test_checkpoint_reshards_bitwise_and_a_changed_value_is_caught(tmp_path):
    folder = tmp_path / "checkpoint"
    common = ["--dir", folder, "--save-at", 2, "--steps", 4]
    saved = launch(WORKERS / "mesh_checkpoint.py", nproc=4, args=["save", *common], echo=False, timeout=120)
    for rank in range(4):
        assert saved.results[rank]["in_flight_at_step_start"]
    files = checkpoint_files(folder / "step-2")
    assert [name for name, _ in files] == [".metadata"] + [f"__{rank}_0.distcp" for rank in range(4)]
    # DCP creates every rank's file even when it is empty: each must hold its quarter of parameters and moments.
    n_params = sum(p.numel() for p in transformer.Transformer().parameters())
    assert all(size >= 3 * n_params for name, size in files if name.endswith(".distcp"))
    # Sizes cannot tell shards from whole tensors spread over the files; .metadata can: every parameter and
    # moment is 4 row ranges, rank r's in rank r's file.
    chunks = checkpoint_chunks(folder / "step-2")
    assert len(chunks) == 3 * 19 and not_sharded_by_rows(chunks, 4) == []
    loaded = launch(WORKERS / "mesh_checkpoint.py", nproc=4, args=["load", "--layout", "fsdp_tp", *common],
                    echo=False, timeout=120)
    for rank in range(4):
        assert loaded.results[rank]["unequal"] == [] and loaded.results[rank]["compared"] == 76
        resumed = loaded.results[rank]["losses"]
        assert max(abs(a - b) for a, b in zip(resumed, saved.results[0]["losses"][2:], strict=True)) < 1e-5
    assert load_in_one_process(folder / "step-2", folder / "full_state.pt")["unequal"] == []
    truth = torch.load(folder / "full_state.pt")
    truth["model.norm.weight"][0] = torch.nextafter(truth["model.norm.weight"][0], torch.tensor(10.0))  # one ulp
    torch.save(truth, folder / "full_state.pt")
    assert load_in_one_process(folder / "step-2", folder / "full_state.pt")["unequal"] == ["model.norm.weight"]


def test_measure_launch_sees_child_processes():
    measured = measure_launch(lambda: subprocess.run([sys.executable, "-c", "import time; time.sleep(0.6)"]).returncode,
                              every=0.05)
    assert measured["value"] == 0 and measured["processes"] >= 1 and measured["pss"] > 0
    assert measured["seconds"] >= 0.6


def test_measure_launch_counts_the_workers_and_agents_a_run_recorded():
    # With the launch server already up, the one sample taken before the launch (every=1 hour) sees only what
    # ran before it; the launch adds one agent and two workers, known only from the run folder (each worker's pid
    # and its parent). Catches a count from sampling alone (it missed a short-lived worker in CI) and one that
    # leaves out the agents (the registered workers alone would make it before + 2).
    import psutil

    from helpers.launcher.processes import LaunchServer

    LaunchServer.get()
    before = len(psutil.Process().children(recursive=True))
    measured = measure_launch(lambda: launch(WORKERS / "whoami.py", nproc=2, echo=False), every=3600)
    assert measured["processes"] == before + 3


@pytest.mark.parametrize("mesh_for, words", [
    (lambda nodes, gpus: ((nodes, gpus), ("dp", "tp")), "Correct:"),
    (lambda nodes, gpus: ((nodes * gpus,), ("dp",)), "named the dimensions"),  # the starting code
    (lambda nodes, gpus: None, "not (mesh_shape, mesh_dim_names)"),
    (lambda nodes, gpus: ((nodes, gpus + 1), ("dp", "tp")), "ranks;"),
    (lambda nodes, gpus: ((nodes, gpus), ("tp", "dp")), "so every layer's collectives would cross the network"),
    (lambda nodes, gpus: ((gpus, nodes), ("dp", "tp")), "use the whole node for tp"),
])
def test_mesh_for_check_says_what_is_wrong(mesh_for, words, capsys):
    assert check_mesh_for(mesh_for) == (words == "Correct:")
    assert words in capsys.readouterr().out


def test_mesh_groups_are_torchs_row_by_row_layout():
    groups = mesh_groups((2, 3), ("dp", "tp"))
    assert groups[4] == {"dp": [1, 4], "tp": [3, 4, 5]}


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
