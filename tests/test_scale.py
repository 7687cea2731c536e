"""Lesson 11's launches: the twin against a real 2-rank gloo run, the twin worker as one plain process, the step-time
worker. The private torch tools the lesson simulates with (pinned), its byte and collective counts and the planner,
which launch nothing, are tested in tests/fast/test_scale_no_launch.py."""
import subprocess
import sys
from pathlib import Path

from helpers import launch
from helpers.lessons.scale import (
    ORDER_PROBE,
    compare_twin,
    first_differing_output,
    increment_report,
    step_time_analysis,
    twin_record,
)

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "helpers" / "workers"


# --- the private APIs -------------------------------------------------------------------------------------------


# --- bytes, counts and the exercise -----------------------------------------------------------------------------




# --- the twin ---------------------------------------------------------------------------------------------------


def test_twin_equals_a_real_two_rank_run_and_a_changed_twin_does_not():
    run = launch(WORKERS / "scale_twin.py", nproc=2, args=["--steps", 1], echo=False)
    twin = twin_record(2, steps=1)
    result = compare_twin(twin, run.results)
    assert result["compared"] == 2 * 39 and not result["differing"], result
    equal, first, _ = first_differing_output(twin, run.results, rank=1)
    assert first is None and equal[0] == "tok_embeddings" and equal[-1] == "output", (equal, first)
    twin[0]["params"]["norm.weight"][1] = twin[0]["params"]["norm.weight"][1] + 1e-7  # catches a blind comparison
    assert compare_twin(twin, run.results)["differing"] == [(0, 1, "params/norm.weight")]
    assert [run.results[r]["order_probe"]["all_reduce"] for r in (0, 1)] == [[ORDER_PROBE[0]] * 2] * 2


def test_twin_worker_runs_as_one_plain_process():
    completed = subprocess.run([sys.executable, str(WORKERS / "scale_twin.py"), "--steps", "1"], cwd=ROOT,
                               capture_output=True, text=True, timeout=120,
                               env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert completed.returncode == 0, completed.stderr


# --- the planner ------------------------------------------------------------------------------------------------


# --- time --------------------------------------------------------------------------------------------------------


def test_step_time_worker_takes_turns_for_every_setting_on_every_rank():
    run = launch(WORKERS / "scale_step_time.py", nproc=2, echo=False,
                 args=["--width", 64, "--layers", 2, "--batch", 8, "--rounds", 5, "--warmup", 1])
    names = {f"all_reduce {size}" for size in run.results[0]["sizes"]} | {"matmul"}
    names |= {f"adam {mode}" for mode in ("local", "fsdp", "fsdp_alone")}  # each set-up's optimizer step alone
    names |= {f"step {mode}" for mode in ("local", "ddp", "fsdp", "fsdp_alone")}
    for rank in (0, 1):
        timings = run.results[rank]["timings"]
        assert set(timings) == names  # every setting, both controls included
        assert all(len(t["wall"]) == len(t["cpu"]) == 5 and min(t["wall"]) > 0 for t in timings.values())
    measured = run.results[0]
    assert measured["n_params"] == 2 * (64 * 64 + 64) and measured["tensors"] == 4
    analysis = step_time_analysis(run.results)
    assert analysis["rounds"] == 5 and set(analysis["verdicts"]) == {"ddp", "fsdp_alone", "fsdp"}
    assert len(increment_report(analysis)) == 4 * 3  # each increment: its name, its verdict, per round, CPU
