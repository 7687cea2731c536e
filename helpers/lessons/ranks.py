"""Lesson 00's exercise: which RANK does torchrun give each process? Checked against a real run.

    from helpers.lessons.ranks import check_global_rank
    check_global_rank(global_rank, workers)   # workers: whoami.py's results, one dict per process

The check's bigger job gets its expected ranks from torch itself: `torch_ranks` runs the elastic agent's own
rank assignment (`_assign_worker_ranks`, torch/distributed/elastic/agent/server/api.py) for several agents, in
threads that share one in-memory store, as real agents share the rendezvous store.

Taught in notebooks/00_start_here.ipynb.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

from helpers.lessons.checks import correct, not_yet


def torch_ranks(procs_per_node: Sequence[int], timeout: float = 30.0) -> dict[tuple[int, int], int]:
    """The RANK torch's elastic agent gives each (node_rank, local_rank) when node k starts procs_per_node[k]
    processes: one agent per node calls `SimpleElasticAgent._assign_worker_ranks` (which never reads the agent
    itself), each in its own thread, and the agents meet in a `HashStore` as they would in the rendezvous store."""
    import torch.distributed as dist
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent, WorkerSpec

    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=timeout))  # a missing agent raises instead of hanging
    ranks: dict[tuple[int, int], int] = {}
    errors: list[BaseException] = []

    def agent(node_rank: int) -> None:
        spec = WorkerSpec(role="trainer", local_world_size=procs_per_node[node_rank], entrypoint="worker.py",
                          rdzv_handler=None)
        try:
            workers = SimpleElasticAgent._assign_worker_ranks(None, store, node_rank, len(procs_per_node), spec)
        except BaseException as error:  # reported below, in the caller's thread
            errors.append(error)
            return
        for worker in workers:
            ranks[node_rank, worker.local_rank] = worker.global_rank

    threads = [threading.Thread(target=agent, args=(node,), daemon=True) for node in range(len(procs_per_node))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout + 5)
    if errors or len(ranks) != sum(procs_per_node):
        raise RuntimeError(f"torch's rank assignment did not finish for {list(procs_per_node)}: {errors}")
    return ranks


def check_global_rank(global_rank: Callable[[int, int, int], int], workers: Sequence[Mapping[str, Any]],
                      bigger_job: tuple[int, int] = (3, 4)) -> bool:
    """Does global_rank(node_rank, local_rank, nproc_per_node) give every process of the run its RANK,
    and every process of a `bigger_job` (nodes, processes per node) the rank torch's elastic agent gives it?"""
    nproc_per_node = len(workers) // len({int(w["node_rank"]) for w in workers})
    cases = [(int(w["node_rank"]), int(w["local_rank"]), nproc_per_node, int(w["rank"]), "of the run above")
             for w in workers]
    nodes, procs = bigger_job
    cases += [(node, local, procs, rank, f"of a {nodes} x {procs} job")
              for (node, local), rank in sorted(torch_ranks([procs] * nodes).items())]
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
