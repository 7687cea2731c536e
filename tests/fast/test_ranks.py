"""Lesson 00's exercise check: it says "Not yet" on the starting code and on plausible wrong formulas; and the
learner's copy of lesson 00 does not give the formula away."""
import json
import re

from helpers import REPO_ROOT
from helpers.lessons.ranks import check_global_rank, torch_ranks
from helpers.tools.workshop import student_cells

# what whoami.py hands back for two nodes of two processes (only the fields the check reads)
RUN = [{"node_rank": node, "local_rank": local, "rank": 2 * node + local} for node in (0, 1) for local in (0, 1)]


def starting_code(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    raise NotImplementedError("your formula")


def test_check_accepts_the_rule_and_rejects_the_start_and_wrong_formulas(capsys):
    assert check_global_rank(lambda node, local, per_node: node * per_node + local, RUN)
    assert capsys.readouterr().out.startswith("Correct: ")
    wrong = [starting_code,
             lambda node, local, per_node: node + local,             # ranks collide across nodes
             lambda node, local, per_node: local * 2 + node,         # transposed layout
             lambda node, local, per_node: node * 2 + local]         # right only for 2 processes per node
    for formula in wrong:
        assert not check_global_rank(formula, RUN)
        assert capsys.readouterr().out.startswith("Not yet: ")


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
    answer = "node_rank * nproc_per_node + local_rank"
    assert answer in text(cells), "the teacher's copy holds the solution"
    handout = text(student_cells(cells))
    for giveaway in (answer, "nproc_per_node + LOCAL_RANK", "RANK // nproc_per_node"):
        assert giveaway not in handout, f"the learner's copy of lesson 00 shows {giveaway!r}"
