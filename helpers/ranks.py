"""Lesson 00's exercise: which RANK does torchrun give each process? Checked against a real run.

    from helpers.ranks import check_global_rank
    check_global_rank(global_rank, workers)   # workers: whoami.py's results, one dict per process

Taught in notebooks/00_start_here.ipynb.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from helpers.checks import correct, not_yet


def torchrun_rank(node_rank: int, local_rank: int, procs_per_node: Sequence[int]) -> int:
    """torch's rule (`_assign_worker_ranks` in torch/distributed/elastic/agent/server/api.py): the ranks of
    node k follow all the processes of nodes 0 .. k-1, in local-rank order."""
    return sum(procs_per_node[:node_rank]) + local_rank


def check_global_rank(global_rank: Callable[[int, int, int], int], workers: Sequence[Mapping[str, Any]],
                      bigger_job: tuple[int, int] = (3, 4)) -> bool:
    """Does global_rank(node_rank, local_rank, nproc_per_node) give every process of the run its RANK,
    and every process of a `bigger_job` (nodes, processes per node) the rank torch's rule gives it?"""
    nproc_per_node = len(workers) // len({int(w["node_rank"]) for w in workers})
    cases = [(int(w["node_rank"]), int(w["local_rank"]), nproc_per_node, int(w["rank"]), "of the run above")
             for w in workers]
    nodes, procs = bigger_job
    cases += [(node, local, procs, torchrun_rank(node, local, [procs] * nodes), f"of a {nodes} x {procs} job")
              for node in range(nodes) for local in range(procs)]
    for node_rank, local_rank, per_node, expected, where in cases:
        try:
            got = global_rank(node_rank, local_rank, per_node)
        except Exception as error:  # the learner's code: any error is an answer to report
            return not_yet(f"global_rank({node_rank}, {local_rank}, {per_node}) raised "
                           f"{type(error).__name__}: {error}")
        if got != expected:
            return not_yet(f"for node_rank {node_rank}, local_rank {local_rank} {where}, global_rank(...) "
                           f"returned {got!r}, but torchrun gives RANK {expected}.")
    return correct(f"global_rank gives the RANK of all {len(workers)} processes of the run above and of all "
                   f"{nodes * procs} processes of a job of {nodes} nodes x {procs} processes.")
