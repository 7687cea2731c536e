"""Lesson 01's library (helpers.lessons.collectives) without a launch: the latency/bandwidth fit, the ring model, bus
bandwidth, and the exercise check's refusal of a collective before it launches anything."""
import pytest

from helpers.lessons.collectives import (
    bandwidth_rows,
    bus_factor,
    check_all_gather,
    fit_latency_bandwidth,
    format_bytes,
    owner,
    predict_allreduce_seconds,
)
from helpers.lessons.listing import excerpt


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


def test_exercise_check_refuses_a_stub_that_calls_all_gather(tmp_path, capsys):
    """Refused before anything launches. That the solution passes is asserted by lesson 01 (nbval's Cell 41)."""
    cheat = tmp_path / "cheat.py"
    cheat.write_text("import torch.distributed as dist\ndist.all_gather([], None)\n")
    assert not check_all_gather(cheat)
    assert "without calling dist.all_gather" in capsys.readouterr().out


def test_excerpt_shows_the_marked_lines_and_names_them(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text("import torch\n\n\ndef f():\n    a = 1\n    return a\n")
    shown = excerpt(script, "def f", "return a").data
    assert shown == "# worker.py, lines 4-6\ndef f():\n    a = 1\n    return a"
