"""Lesson 01's library (helpers.lessons.collectives) without a launch: the latency/bandwidth fit, the ring model, bus
bandwidth, the exercise check's refusal of a collective and of requests never waited for before it launches anything,
its reading of a hang and of torch's record of the collectives, and the private torch API that record comes from."""
from pathlib import Path

import pytest

from helpers import WORKERS
from helpers.launcher.api import Run
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


SOLUTION = (WORKERS / "collectives_all_gather_solution.py").read_text()
POSTS = ("            requests.append(dist.isend(tensor, dst=other))\n"
         "            requests.append(dist.irecv(gathered[other], src=other))\n")


@pytest.mark.parametrize("new, thrown", [
    # the isend's request thrown away, then a blocking recv (gloo can cancel the send: every rank waits in recv)
    ("            dist.isend(tensor, dst=other)\n            dist.recv(gathered[other], src=other)\n", "isend"),
    # the irecv's request thrown away: its buffer is read before anything arrived, or the sender waits forever
    ("            requests.append(dist.isend(tensor, dst=other))\n            dist.irecv(gathered[other], src=other)\n",
     "irecv"),
    # requests built in one statement and dropped with it
    ("            [dist.isend(tensor, dst=other), dist.irecv(gathered[other], src=other)]\n", "isend"),
    ("            requests.append(dist.irecv(gathered[other], src=other))\n"
     "    [dist.isend(tensor, dst=o) for o in range(world_size) if o != rank]\n", "isend"),
])
def test_exercise_check_names_a_request_thrown_away_before_launching(tmp_path, capsys, new, thrown):
    assert POSTS in SOLUTION
    script = tmp_path / "my_all_gather.py"
    script.write_text(SOLUTION.replace(POSTS, new))
    line = next(number for number, text in enumerate(script.read_text().splitlines(), 1)
                if f"dist.{thrown}(" in text and "append" not in text)
    assert not check_all_gather(script)
    out = capsys.readouterr().out
    assert "Running" not in out, "it launched: the mistake is in the source, and a launch may hang on it"
    assert f"Not yet: line {line} throws away the request that dist.{thrown}(...) returns" in out, out
    assert "call wait() on each" in out, out


def test_exercise_check_names_requests_kept_but_never_waited_for(tmp_path, capsys):
    script = tmp_path / "my_all_gather.py"
    script.write_text(SOLUTION.replace("    for request in requests:\n        request.wait()\n", ""))
    assert not check_all_gather(script)
    assert "never waited for (there is no wait() in the script)" in capsys.readouterr().out


@pytest.mark.parametrize("posts", [
    POSTS,  # the solution
    "            dist.isend(tensor, dst=other).wait()\n"
    "            requests.append(dist.irecv(gathered[other], other))\n",
    "            requests += [dist.isend(tensor, other), dist.irecv(gathered[other], other)]\n",
    "            requests += dist.batch_isend_irecv([dist.P2POp(dist.irecv, gathered[other], other)])\n",
])
def test_requests_kept_and_waited_for_are_not_refused(posts):
    from helpers.lessons.collectives import _unwaited_requests

    assert _unwaited_requests(SOLUTION.replace(POSTS, posts)) is None
    assert _unwaited_requests(SOLUTION.replace(POSTS, posts).replace(
        "    for request in requests:\n        request.wait()\n",
        "    torch.futures.wait_all([request.get_future() for request in requests])\n")) is None


def test_a_hang_is_read_from_where_the_ranks_wait():
    from helpers.lessons.collectives import _reading_of_a_hang

    sends = _reading_of_a_hang({0: "waiting in dist.send at a.py:9", 1: "waiting in dist.send at a.py:9"})
    assert sends.startswith("Ranks 0, 1 sat in a blocking dist.send") and "deadlock" in sends
    lost = _reading_of_a_hang({0: "waiting in dist.recv at a.py:12", 1: "in request.wait at a.py:14",
                               2: "not in a.py: it has returned, or not started yet"})
    assert lost.startswith("Ranks 0, 1 waited for a message that never completed") and "deadlock" not in lost
    assert _reading_of_a_hang({0: "in time.sleep at a.py:3"}).startswith("No rank was in send or recv")


def test_the_collectives_torch_recorded_are_read_by_name():
    from helpers.lessons.collectives import _collectives_recorded

    def run(*names):
        return Run("x.py", 2, Path("."), results={0: {"collectives": list(names)}, 1: {}})

    assert _collectives_recorded(run("gloo:barrier", "nccl:send 0->1", "nccl:recv 1->0")) is None
    for name, operation in (("gloo:all_gather", "all_gather"), ("nccl:_allgather_base", "_allgather_base"),
                            ("gloo:broadcast", "broadcast"), ("gloo:alltoall_base", "alltoall_base"),
                            ("gloo:reduce_scatter", "reduce_scatter")):
        assert _collectives_recorded(run("gloo:barrier", name)) == operation


def test_pin_torchs_flight_recorder_logs_gloo_collectives_by_name():
    """helpers/workers/collectives_all_gather_check.py hands back what this private API logged, so that the exercise's
    check refuses a collective the source hides (getattr(dist, "all_" + "gather")). If torch stops logging gloo's
    collectives there, or renames them, this fails instead of the check passing such an answer."""
    import json

    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace_json

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        getattr(dist, "all_" + "gather")([torch.empty(2)], torch.ones(2))
        dist.barrier()
    finally:
        dist.destroy_process_group()  # the record outlives the group, as the harness needs
    names = [entry["profiling_name"] for entry in json.loads(_dump_fr_trace_json())["entries"]]
    assert names[-2:] == ["gloo:all_gather", "gloo:barrier"], names
