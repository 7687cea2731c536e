"""Lesson 01's library (helpers.lessons.collectives) and the exercise's check. The collectives_* workers are launched,
and asserted, by the lesson (notebooks/01_collectives.ipynb, under pytest --nbval); here only what the lesson does
not check: the hand-written ring on one rank and on chunks of unequal size, and that the exercise's check says "Not
yet", naming the mistake, to a send deadlock and a lost message (read from where the ranks wait), to tensors out of
order, to a collective hidden from the source (torch's flight recorder), to a stub and to a crash (naming the
learner's line), and "Correct" to answers built differently. What launches nothing (the missing wait()s among
them) is tested in tests/fast/test_collectives_no_launch.py. The check on the starting code and on the solution is
asserted by the lesson (its exercise's two check cells, under nbval)."""

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


SOLUTION = (WORKERS / "collectives_all_gather_solution.py").read_text()
POSTS = ("            requests.append(dist.isend(tensor, dst=other))\n"
         "            requests.append(dist.irecv(gathered[other], src=other))\n")


def learners_answer(tmp_path, name, old, new):
    """The solution with one change a learner might make (`old` must be in it)."""
    assert old in SOLUTION
    script = tmp_path / name
    script.write_text(SOLUTION.replace(old, new))
    return script, script.read_text().splitlines()


def test_exercise_check_reads_a_send_deadlock_from_where_the_ranks_wait(tmp_path, capsys):
    script, lines = learners_answer(tmp_path, "stuck.py", POSTS,
                                    "            dist.send(tensor, dst=other)\n"
                                    "            dist.recv(gathered[other], src=other)\n")
    line = lines.index("            dist.send(tensor, dst=other)") + 1
    assert not check_all_gather(script, nproc=2, timeout=3)
    said = capsys.readouterr().out
    assert f"rank 0: waiting in dist.send at stuck.py:{line}" in said, said
    assert "sat in a blocking dist.send" in said and "deadlock" in said, said


def test_exercise_check_reads_a_lost_message_from_where_the_ranks_wait(tmp_path, capsys):
    """Every rank posts its receives and waits, and nobody sends: the message must name a lost message (recv,
    wait()), not a send deadlock."""
    script, lines = learners_answer(tmp_path, "no_send.py", POSTS,
                                    "            requests.append(dist.irecv(gathered[other], src=other))\n")
    line = lines.index("        request.wait()") + 1
    assert not check_all_gather(script, nproc=2, timeout=3)
    said = capsys.readouterr().out
    assert f"rank 1: in request.wait at no_send.py:{line}" in said, said
    assert "waited for a message that never completed" in said and "blocking dist.send" not in said, said


def test_exercise_check_names_messages_out_of_order_and_a_collective_torch_recorded(tmp_path, capsys):
    # every tensor arrives, in the wrong entries (as a recv without src= files them in arrival order); here
    # rank 0 files rank 1's tensor under entry 0 and its own under entry 1
    order, _ = learners_answer(tmp_path, "order.py", "    return gathered\n",
                               "    return gathered[::-1] if rank == 0 else gathered\n")
    assert not check_all_gather(order, nproc=2)
    said = capsys.readouterr().out
    assert "rank 0 holds every rank's tensor, but out of order: its entry 0 is rank 1's tensor" in said, said
    assert "recv(..., src=j)" in said
    hidden = tmp_path / "hidden.py"  # a collective the source does not name: torch's own record gives it away
    loop = "    for other in range(world_size):\n        if other != rank:\n" + POSTS
    assert loop in SOLUTION
    hidden.write_text(SOLUTION.replace(loop, "    getattr(dist, 'all_' + 'gather')(gathered, tensor)\n"))
    assert not check_all_gather(hidden, nproc=2)
    assert "torch recorded a dist.all_gather call while your script ran" in capsys.readouterr().out


@pytest.mark.parametrize("name, old, new", [
    ("batched.py", POSTS, "            requests += dist.batch_isend_irecv([\n"
                          "                dist.P2POp(dist.isend, tensor, other), "
                          "dist.P2POp(dist.irecv, gathered[other], other)])\n"),
    ("ordered.py", POSTS, "            first, second = ((dist.send, dist.recv) if rank < other\n"
                          "                             else (dist.recv, dist.send))\n"
                          "            first(tensor if first is dist.send else gathered[other], other)\n"
                          "            second(tensor if second is dist.send else gathered[other], other)\n"),
])
def test_exercise_check_passes_answers_built_differently(tmp_path, capsys, name, old, new):
    """batch_isend_irecv, and blocking send/recv ordered so that each pair cannot deadlock."""
    script, _ = learners_answer(tmp_path, name, old, new)
    assert check_all_gather(script, nproc=3), capsys.readouterr().out


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
    assert "entry 1 holds [-1.0, -1.0, -1.0], which is no rank's tensor" in out and "read before its wait()" in out


def test_exercise_check_names_a_receive_into_the_wrong_entry(tmp_path, capsys):
    """A walkthrough's learner received rank j's tensor into entry j + 1 and heard "did you wait()?": the check now
    names the entry that holds another rank's tensor and the index to receive into."""
    solution = (WORKERS / "collectives_all_gather_solution.py").read_text()
    assert "dist.irecv(gathered[other], src=other)" in solution
    script = tmp_path / "off_by_one.py"
    script.write_text(solution.replace("torch.empty_like(tensor) for _", "torch.full_like(tensor, -1.0) for _")
                      .replace("dist.irecv(gathered[other], src=other)",
                               "dist.irecv(gathered[(other + 1) % world_size], src=other)"))
    assert not check_all_gather(script)
    out = capsys.readouterr().out.splitlines()[-1]
    assert "values no rank sent (nothing was received into it), and entry" in out, out
    assert "receive rank j's tensor into entry j" in out and "wait()" not in out, out


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
