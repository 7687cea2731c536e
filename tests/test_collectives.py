"""Lesson 01's workers and helpers, with real launches at the smallest size that shows the behaviour."""

import pytest

from helpers import WORKERS, launch
from helpers.collectives import (
    bandwidth_rows,
    bus_factor,
    check_all_gather,
    fit_latency_bandwidth,
    format_bytes,
    owner,
    predict_allreduce_seconds,
)


def test_tour_gives_every_collective_its_documented_result():
    run = launch(WORKERS / "collectives_tour.py", nproc=2, echo=False)
    seen = {rank: run.results[rank]["tensors"] for rank in (0, 1)}
    assert seen[1]["send/recv"]["after"] == [1.0, 2.0, 3.0, 4.0]
    assert seen[0]["isend/irecv"]["after"] == [11.0, 12.0, 13.0, 14.0]
    assert seen[1]["broadcast"]["after"] == [1.0, 2.0, 3.0, 4.0]
    assert seen[0]["reduce"]["after"] == [12.0, 14.0, 16.0, 18.0]
    assert all(seen[r]["all_reduce"]["after"] == [12.0, 14.0, 16.0, 18.0] for r in (0, 1))
    assert seen[0]["reduce_scatter"]["after"] == [12.0, 14.0]
    assert seen[1]["reduce_scatter"]["after"] == [16.0, 18.0]
    assert all(seen[r]["all_gather"]["after"] == [12.0, 14.0, 16.0, 18.0] for r in (0, 1))
    assert [seen[r]["scatter"]["after"] for r in (0, 1)] == [[1.0, 2.0], [3.0, 4.0]]
    assert seen[0]["gather"]["after"] == [1.0, 2.0, 3.0, 4.0, 11.0, 12.0, 13.0, 14.0]
    assert seen[1]["gather"]["after"] == []  # only dst receives
    assert [seen[r]["all_to_all"]["after"] for r in (0, 1)] == [[1.0, 2.0, 11.0, 12.0], [3.0, 4.0, 13.0, 14.0]]
    assert all(seen[r]["all_reduce(async_op=True)"]["after"] == [12.0, 14.0, 16.0, 18.0] for r in (0, 1))
    handle = run.results[0]["work_handle"]  # rank 0 is on time, rank 1 joins late
    assert not handle["completed_at_return"] and handle["completed_after_wait"]
    barrier = [run.results[r]["barrier"] for r in (0, 1)]
    assert min(t["left"] for t in barrier) >= max(t["arrived"] for t in barrier)


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


def test_bandwidth_sweep_returns_one_time_per_size():
    run = launch(WORKERS / "collectives_bandwidth.py", nproc=2, echo=False,
                 args=["--min-bytes", 1024, "--max-bytes", 16384, "--repeats", 2])
    assert run.results[0]["sizes"] == [1024, 4096, 16384]
    assert len(run.results[0]["seconds"]) == 3 and all(t > 0 for t in run.results[0]["seconds"])
    assert [row["bytes"] for row in run.metrics if row["rank"] == 1] == [1024, 4096, 16384]


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
    stuck.write_text("import time\ntime.sleep(30)\n")
    assert not check_all_gather(stuck, nproc=1, timeout=3)
    assert "deadlock" in capsys.readouterr().out


def test_blocking_send_both_ways_waits_until_the_group_times_out():
    run = launch(WORKERS / "collectives_deadlock.py", nproc=2, echo=False, args=["--timeout-seconds", 1])
    outcomes = [run.results[rank]["outcome"] for rank in (0, 1)]
    assert "completed" not in outcomes
    assert any("Timed out waiting 1000ms for send operation to complete" in outcome for outcome in outcomes)
