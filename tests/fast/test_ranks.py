"""Lesson 00's exercise check: it says "Not yet" on the starting code and on the formulas a learner would write
wrong, each with a message that names the mistake; it accepts right answers however they are written; and the
learner's copy of lesson 00 does not give the formula away."""
import itertools
import json
import re

import pytest

from helpers import REPO_ROOT
from helpers.lessons.ranks import check_global_rank, torch_ranks
from helpers.tools.workshop import student_cells

# what whoami.py hands back for two nodes of two processes (only the fields the check reads)
RUN = [{"node_rank": node, "local_rank": local, "rank": 2 * node + local} for node in (0, 1) for local in (0, 1)]


def starting_code(node_rank: int, local_rank: int, procs_per_node: list[int]) -> int:
    raise NotImplementedError("your formula here")


def running_total(node_rank: int, local_rank: int, procs_per_node: list[int]) -> int:
    rank = local_rank
    for node in range(node_rank):
        rank += procs_per_node[node]
    return rank


WRONG = [
    (starting_code, "raised NotImplementedError: your formula here"),
    # every node as big as this one: right for the run above, two processes share a rank in the uneven job
    (lambda node, local, procs: node * procs[node] + local,
     "Right for the run above, where every node runs 2 processes; wrong for nodes of different sizes: in a job "
     "whose nodes run [3, 1, 4] processes, two processes got RANK 1: node 0's local rank 1 and node 1's local rank 0"),
    # every node as big as node 0
    (lambda node, local, procs: node * procs[0] + local,
     "Right for the run above, where every node runs 2 processes; wrong for nodes of different sizes: "
     "global_rank(2, 0, [3, 1, 4]) returned 6, but torchrun gives RANK 4"),
    # the number of nodes mistaken for the number of processes per node (equal, 2, in the run above)
    (lambda node, local, procs: node * len(procs) + local, "global_rank(2, 0, [3, 1, 4]) returned 6"),
    (lambda node, local, procs: node + local,
     "in the run above, two processes got RANK 1: node 0's local rank 1 and node 1's local rank 0"),
    # ranks dealt round-robin over the nodes
    (lambda node, local, procs: local * len(procs) + node,
     "node 0's local ranks 0 and 1 got RANKs 0 and 2. torchrun gives the processes of one node consecutive ranks"),
    # this node's own processes counted too
    (lambda node, local, procs: sum(procs[:node + 1]) + local,
     "global_rank(0, 0, [2, 2]) returned 2, but the job's first process (node 0, local rank 0) gets RANK 0"),
    (lambda node, local, procs: sum(procs[:node]) + local + 1, "returned 1, but the job's first process"),
    (lambda node, local, procs: None, "returned None (NoneType); RANK is a number"),
]

RIGHT = [
    lambda node, local, procs: sum(procs[:node]) + local,
    running_total,
    lambda node, local, procs: [0, *itertools.accumulate(procs)][node] + local,
    lambda node, local, procs: sum(procs[k] for k in range(node)) + local,
]


@pytest.mark.parametrize("formula, message", WRONG)
def test_check_names_the_mistake_of_each_wrong_formula(formula, message, capsys):
    assert not check_global_rank(formula, RUN)
    said = capsys.readouterr().out
    assert said.startswith("Not yet: ") and message in said, said


@pytest.mark.parametrize("formula", RIGHT)
def test_check_accepts_right_formulas_however_written(formula, capsys):
    assert check_global_rank(formula, RUN)
    assert capsys.readouterr().out.startswith("Correct: ")


def test_torch_ranks_counts_every_process_of_the_nodes_before():
    # torch's own agents, with uneven nodes: node 1's ranks come after node 0's 2 processes
    assert torch_ranks([2, 3]) == {(0, 0): 0, (0, 1): 1, (1, 0): 2, (1, 1): 3, (1, 2): 4}


def test_the_module_the_exercise_names_holds_no_formula():
    # lesson 00's exercise names helpers/lessons/ranks.py; the learner's copy of it must not hold the answer
    source = (REPO_ROOT / "helpers" / "lessons" / "ranks.py").read_text(encoding="utf-8")
    assert not re.search(r"\+\s*local_rank|local_rank\s*\+|\*\s*n?procs?_per_node|procs_per_node\[:", source)


def test_the_student_copy_of_lesson_00_does_not_give_the_formula_away():
    cells = json.loads((REPO_ROOT / "notebooks" / "00_start_here.ipynb").read_text(encoding="utf-8"))["cells"]
    text = lambda kept: "\n".join("".join(cell["source"]) for cell in kept)  # noqa: E731
    answer = "sum(procs_per_node[:node_rank]) + local_rank"
    assert answer in text(cells), "the teacher's copy holds the solution"
    handout = text(student_cells(cells))
    for giveaway in (answer, "procs_per_node[:node_rank]", "node_rank * n + local_rank", "RANK // nproc_per_node"):
        assert giveaway not in handout, f"the learner's copy of lesson 00 shows {giveaway!r}"
