"""Lesson 01's library (helpers.lessons.collectives) and the exercise's check. The collectives_* workers are launched,
and asserted, by the lesson (notebooks/01_collectives.ipynb, under pytest --nbval); here only what the lesson does
not check: the hand-written ring on one rank and on chunks of unequal size, and that the exercise's check says "Not
yet" to a stub, to a deadlock and to a crash (naming the learner's line). What launches nothing is tested in
tests/fast/test_collectives_no_launch.py. The check on the starting code and on the solution is asserted by the
lesson (its exercise's two check cells, under nbval)."""

import pytest

from helpers import WORKERS, launch
from helpers.lessons.collectives import (
    bus_factor,
    check_all_gather,
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
