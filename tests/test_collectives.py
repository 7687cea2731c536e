"""Lesson 01's library (helpers.lessons.collectives) and the exercise's check. The collectives_* workers are launched,
and asserted, by the lesson (notebooks/01_collectives.ipynb, under pytest --nbval); here only what the lesson does not
check: the hand-written ring on one rank and on chunks of unequal size, and that the exercise's check says "Not yet"
to a stub and to a deadlock."""

import pytest

from helpers import WORKERS, launch
from helpers.lessons.collectives import (
    bandwidth_rows,
    bus_factor,
    check_all_gather,
    excerpt,
    fit_latency_bandwidth,
    format_bytes,
    owner,
    predict_allreduce_seconds,
    ring_holdings,
)


@pytest.mark.parametrize("nproc, numel", [(1, 3000), (3, 3001)])  # 3001: chunks of unequal size
def test_hand_written_ring_matches_all_reduce_and_sends_the_ring_share(nproc, numel):
    run = launch(WORKERS / "collectives_ring.py", nproc=nproc, args=["--numel", numel], echo=False)
    for rank in range(nproc):
        outcome = run.results[rank]
        assert outcome["max_abs_diff"] < 1e-5
        share = bus_factor(nproc) * outcome["tensor_bytes"]
        assert abs(outcome["bytes_sent"] - share) <= 2 * (nproc - 1) * 4  # at most a float per step
        if outcome["ring_os_bytes"] is not None:  # Linux: the OS saw at least those bytes, plus headers
            assert share <= outcome["ring_os_bytes"] <= share + 1024 * max(nproc - 1, 0)
    # the lesson's picture: after the reduce-scatter rank r owns chunk (r+1) % N whole; at the end every chunk is
    holdings = ring_holdings(run)
    assert len(holdings) == 2 * (nproc - 1) + 1
    assert all(len(holdings[nproc - 1][r][(r + 1) % nproc]) == nproc for r in range(nproc))
    assert all(members == list(range(nproc)) for rank in holdings[-1] for members in rank)


def test_exercise_check_accepts_the_solution_and_rejects_a_stub(tmp_path, capsys):
    assert check_all_gather(WORKERS / "collectives_all_gather_solution.py")
    cheat = tmp_path / "cheat.py"
    cheat.write_text("import torch.distributed as dist\ndist.all_gather([], None)\n")
    assert not check_all_gather(cheat)
    assert "without calling dist.all_gather" in capsys.readouterr().out


def test_fit_recovers_latency_and_bandwidth():
    sizes = [1024 * 4**i for i in range(9)]
    latency, bandwidth = fit_latency_bandwidth(sizes, [50e-6 + size / 2e9 for size in sizes])
    assert latency == pytest.approx(50e-6, rel=1e-6) and bandwidth == pytest.approx(2e9, rel=1e-6)


def test_ring_model_reproduces_the_two_rank_fit_and_grows_with_ranks():
    latency, bandwidth, size = 1e-3, 5e8, 64 * 2**20
    assert predict_allreduce_seconds(size, 2, latency, bandwidth) == pytest.approx(latency + size / bandwidth)
    assert predict_allreduce_seconds(size, 1, latency, bandwidth) == 0.0
    # 8 ranks: 14 steps of latency / 2 each, and 1.75 S bytes per rank
    eight = predict_allreduce_seconds(size, 8, latency, bandwidth)
    assert eight == pytest.approx(7 * latency + 1.75 * size / bandwidth)
    with pytest.raises(ValueError):
        predict_allreduce_seconds(size, 8, latency, bandwidth, algorithm="butterfly")


def test_bus_bandwidth_and_small_helpers():
    assert [bus_factor(n) for n in (1, 2, 4, 8)] == [0.0, 1.0, 1.5, 1.75]
    row = bandwidth_rows([1_000_000], [0.001], world_size=4)[0]
    assert row["algbw GB/s"] == pytest.approx(1.0) and row["busbw GB/s"] == pytest.approx(1.5)
    assert [format_bytes(s) for s in (512, 1024, 64 * 2**20)] == ["512 B", "1 KB", "64 MB"]
    assert owner(23, world_size=4, length=4) == 2 and owner(64, world_size=4, length=4) is None


def test_exercise_check_reports_a_deadlock(tmp_path, capsys):
    stuck = tmp_path / "stuck.py"
    stuck.write_text("import time\nprint('ready', flush=True)\ntime.sleep(30)\n")
    assert not check_all_gather(stuck, nproc=1, timeout=3)
    said = capsys.readouterr().out
    assert "deadlock" in said and "rank 0: " in said and "stuck.py:3" in said, said  # says where the rank waits


def test_exercise_check_names_the_unfilled_own_slot_and_refuses_an_imported_collective(tmp_path, capsys):
    solution = (WORKERS / "collectives_all_gather_solution.py").read_text()
    assert "    gathered[rank] = tensor.clone()\n" in solution
    forgot = tmp_path / "forgot_own.py"
    forgot.write_text(solution.replace("    gathered[rank] = tensor.clone()\n", "    gathered[rank].fill_(-1)\n"))
    assert not check_all_gather(forgot)
    assert "(its own tensor) was never filled" in capsys.readouterr().out
    renamed = tmp_path / "renamed.py"
    renamed.write_text("from torch.distributed import all_gather as ag\nag([], None)\n")
    assert not check_all_gather(renamed)
    assert "without calling dist.all_gather" in capsys.readouterr().out


@pytest.mark.parametrize("name", [
    "all_gather", "all_gather_into_tensor", "all_gather_single", "all_gather_object", "all_reduce", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list",
    "send_object_list", "recv_object_list"])
def test_exercise_check_refuses_every_collective_by_name(tmp_path, capsys, name):
    """Each of these gives the right answer without point-to-point tensors; the check refuses it before launching."""
    for source in (f"import torch.distributed as dist\ndist.{name}(a, b)\n",
                   f"import torch.distributed as D\nD.{name}(a, b)\n",
                   f"from torch.distributed import distributed_c10d as c\nc.{name} (a, b)\n",
                   f"torch.distributed.{name}(a, b)\n",
                   f"from torch.distributed import {name} as x\n"):
        script = tmp_path / "uses_a_collective.py"
        script.write_text(source)
        assert not check_all_gather(script)
        assert f"without calling dist.{name} " in capsys.readouterr().out


def test_exercise_check_refuses_a_star_import(tmp_path, capsys):
    script = tmp_path / "star.py"
    script.write_text("from torch.distributed import *\nall_gather(a, b)\n")
    assert not check_all_gather(script)
    assert "star import" in capsys.readouterr().out


@pytest.mark.parametrize("source", [
    "def all_gather_by_hand(t):\n    return t.gather(0, t)\nall_gather_by_hand(1)\n",
    "from functools import reduce\ntotal = reduce(lambda a, b: a + b, [1, 2])\n",
    "import functools\ntotal = functools.reduce(lambda a, b: a + b, [1, 2])\n",
    "def gather(pieces):\n    return pieces\ngather([1])\nt.scatter(0, index, src)\n",
])
def test_exercise_check_does_not_refuse_names_that_are_not_torch_collectives(source):
    from helpers.lessons.collectives import _collective_used
    assert _collective_used(source) is None


def test_tour_on_three_ranks_keeps_subgroups_and_averages_apart():
    """The lesson runs the tour on 4 ranks; 3 gives halves of unequal size ([0, 1] and [2])."""
    run = launch(WORKERS / "collectives_tour.py", nproc=3, echo=False)
    assert run.results[0]["subgroups"] == [[0, 1], [2]]
    starting = [run.results[rank]["tensors"]["all_reduce"]["before"] for rank in range(3)]
    first_pair = [a + b for a, b in zip(starting[0], starting[1], strict=True)]
    after = [run.results[rank]["tensors"]["all_reduce in a subgroup"]["after"] for rank in range(3)]
    assert after == [first_pair, first_pair, starting[2]]  # a group of one all-reduces with itself
    averaged = [run.results[rank]["tensors"]["all_reduce(op=AVG)"]["before"] for rank in range(3)]
    mean = [sum(column) / 3 for column in zip(*averaged, strict=True)]
    assert len(mean) == 8  # not the world size: an AVG dividing by the tensor's length would differ
    for rank in range(3):
        assert run.results[rank]["tensors"]["all_reduce(op=AVG)"]["after"] == pytest.approx(mean)
        # gloo's AVG sums first (float16 overflow), dividing first does not; DDP divides first
        assert run.results[rank]["tensors"]["fp16 all_reduce(op=AVG)"]["after"] == [float("inf")] * 2
        assert run.results[rank]["tensors"]["fp16 divide by N, then SUM"]["after"] == [40000.0] * 2
        assert run.results[rank]["ddp_fp16_gradient"] == [40000.0] * 2
        assert "error" in run.results[rank]["integer_avg"]


def test_exercise_check_asks_about_wait_when_an_entry_holds_values_no_rank_sent(tmp_path, capsys):
    # a deterministic stand-in for reading an irecv's buffer before its wait(): the buffers the answer reads
    # are never written, so they hold whatever they started with (-1 here, memory garbage in the real mistake)
    solution = (WORKERS / "collectives_all_gather_solution.py").read_text()
    for mistake in ("torch.empty_like(tensor) for _", "dist.irecv(gathered[other], src=other)"):
        assert mistake in solution
    script = tmp_path / "unread.py"
    script.write_text(solution.replace("torch.empty_like(tensor) for _", "torch.full_like(tensor, -1.0) for _")
                      .replace("dist.irecv(gathered[other], src=other)",
                               "dist.irecv(torch.empty_like(tensor), src=other)"))
    assert not check_all_gather(script)
    out = capsys.readouterr().out
    assert "entry 1 holds [-1.0, -1.0, -1.0], values no rank sent: did you wait() on every irecv" in out


def test_exercise_check_names_the_learners_line_when_the_script_crashes(tmp_path, capsys):
    """A learner's all_gather that raises (here: one slot too many) gets the rank, its own file:line and the error."""
    solution = (WORKERS / "collectives_all_gather_solution.py").read_text()
    mistake = "    gathered = [torch.empty_like(tensor) for _ in range(world_size)]\n"
    assert mistake in solution
    script = tmp_path / "my_all_gather.py"
    script.write_text(solution.replace(mistake, mistake + "    gathered[world_size].zero_()\n"))
    line = script.read_text().splitlines().index("    gathered[world_size].zero_()") + 1
    assert not check_all_gather(script)
    out = capsys.readouterr().out
    assert "Not yet: my_all_gather.py crashed on rank " in out and f"my_all_gather.py:{line}" in out, out
    assert "IndexError: list index out of range" in out and "rank<N>.log" in out, out


def test_excerpt_shows_the_marked_lines_and_names_them(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import torch\n\n\ndef f():\n    a = 1\n    return a\n")
    shown = excerpt(script, "def f", "return a").data
    assert shown == "# worker.py, lines 4-6\ndef f():\n    a = 1\n    return a"
