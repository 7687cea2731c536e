"""Lesson 00's exercise check: it says "Not yet" on the starting code and on plausible wrong formulas."""
from helpers.ranks import check_global_rank, torchrun_rank

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


def test_torchrun_rule_counts_every_process_of_the_nodes_before():
    assert [torchrun_rank(node, local, [2, 3]) for node, local in [(0, 0), (0, 1), (1, 0), (1, 2)]] == [0, 1, 2, 4]
