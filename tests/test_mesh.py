"""Lesson 10 (meshes): helpers/kit/transformer.py, helpers/lessons/mesh.py and the mesh_* workers, at the smallest
sizes. What launches nothing is tested in tests/fast/test_mesh_no_launch.py and tests/fast/test_lessons_10_11.py. The
two exercise checks on their starting code and on their solutions are asserted by the lesson
(notebooks/10_meshes.ipynb); here, the wrong answers (the TP plan's in one launch, with the answer and a
right-but-different plan beside them, which cost nothing more there) and a plan file that crashes."""
import subprocess
import sys
import warnings
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


@pytest.fixture
def keep_the_launch_server(monkeypatch):
    """mesh_groups stops the kernel's launch server before its child imports torch (lesson 10's memory budget).
    Here the other tests' launches would pay a new server's start for it."""
    monkeypatch.setattr("helpers.launcher.api.stop_launch_server", lambda before=None: None)


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
                      "torch refused the plan on 2 ranks, in w3's forward"),  # the worker names the layer
    "all column-wise": ('PLAN = {"w1": ColwiseParallel(), "w3": ColwiseParallel(), "w2": ColwiseParallel()}',
                        "torch refused the plan on 2 ranks, in w2's forward"),
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


def _launch_again_after_a_segfault(*args, **kwargs):
    """One more launch, only when a rank died of SIGSEGV. Once, in CI's full suite (7 December), rank 1 of the load
    below segfaulted in step 3's backward while its main thread waited in a DTensor reduce_scatter on gloo, and the
    crashing thread had no Python frame (gloo's own): a crash inside gloo, not what this test checks; 0 of 170 such
    launches here. The save and the load redo the same work when launched again; a second segfault fails the test."""
    try:
        return launch(*args, **kwargs)
    except WorkerFailed as failure:
        if failure.exitcode != -11:
            raise
        warnings.warn(f"launched once more after: {failure}", stacklevel=2)
        return launch(*args, **kwargs)


def test_checkpoint_reshards_bitwise_and_a_changed_value_is_caught(tmp_path):
    folder = tmp_path / "checkpoint"
    common = ["--dir", folder, "--save-at", 2, "--steps", 4]
    saved = _launch_again_after_a_segfault(WORKERS / "mesh_checkpoint.py", nproc=4, args=["save", *common],
                                           echo=False, timeout=120)
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
    loaded = _launch_again_after_a_segfault(WORKERS / "mesh_checkpoint.py", nproc=4,
                                            args=["load", "--layout", "fsdp_tp", *common], echo=False, timeout=120)
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
    (lambda nodes, gpus: ((nodes * gpus,), ("dp",)), "named the dimensions"),  # the starting code
    (lambda nodes, gpus: None, "not (mesh_shape, mesh_dim_names)"),
    (lambda nodes, gpus: ((nodes, gpus + 1), ("dp", "tp")), "ranks;"),
    (lambda nodes, gpus: ((nodes, gpus), ("tp", "dp")), "so every layer's collectives would cross the network"),
    (lambda nodes, gpus: ((gpus, nodes), ("dp", "tp")), "use the whole node for tp"),
])


def test_mesh_for_check_says_what_is_wrong(mesh_for, words, capsys, keep_the_launch_server):
    assert not check_mesh_for(mesh_for)
    assert words in capsys.readouterr().out


def test_mesh_groups_are_torchs_row_by_row_layout(keep_the_launch_server):
    groups = mesh_groups((2, 3), ("dp", "tp"))
    assert groups[4] == {"dp": [1, 4], "tp": [3, 4, 5]}
