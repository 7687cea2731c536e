"""Lesson 00's exercise: which RANK does torchrun give each process? Checked against a real run.

    from helpers.lessons.ranks import check_global_rank
    check_global_rank(global_rank, workers)   # workers: whoami.py's results, one dict per process

global_rank(node_rank, local_rank, procs_per_node) is the learner's: procs_per_node[k] is how many processes node k
runs. The check's second job, whose nodes run different numbers of processes, gets its expected ranks from torch
itself: `torch_ranks` runs the elastic agent's own rank assignment (`_assign_worker_ranks`,
torch/distributed/elastic/agent/server/api.py) for several agents, in threads that share one in-memory store, as
real agents share the rendezvous store.

Taught in notebooks/00_start_here.ipynb.
"""
from __future__ import annotations

import numbers
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


def check_global_rank(global_rank: Callable[[int, int, list[int]], int], workers: Sequence[Mapping[str, Any]],
                      uneven_job: Sequence[int] = (3, 1, 4)) -> bool:
    """Does global_rank(node_rank, local_rank, procs_per_node) give every process of the run its RANK, and every
    process of a job whose nodes run `uneven_job` processes the rank torch's elastic agent gives it?"""
    per_node = [0] * (1 + max(int(w["node_rank"]) for w in workers))
    for w in workers:
        per_node[int(w["node_rank"])] += 1
    jobs = [(per_node, {(int(w["node_rank"]), int(w["local_rank"])): int(w["rank"]) for w in workers},
             "the run above"),
            (list(uneven_job), torch_ranks(list(uneven_job)), f"a job whose nodes run {list(uneven_job)} processes")]
    for procs, expected, where in jobs:
        got: dict[tuple[int, int], Any] = {}
        for node_rank, local_rank in sorted(expected):
            try:
                got[node_rank, local_rank] = global_rank(node_rank, local_rank, list(procs))
            except Exception as error:  # the learner's code: any error is an answer to report
                return not_yet(f"global_rank({node_rank}, {local_rank}, {procs}) raised "
                               f"{type(error).__name__}: {error}")
        if got != expected:
            right_so_far = "" if where == "the run above" else (
                f"Right for the run above, where every node runs {per_node[0]} processes; wrong for nodes of "
                "different sizes: ")
            return not_yet(right_so_far + _what_is_wrong(got, expected, procs, where))
    return correct(f"global_rank gives the RANK torchrun gives every process of the run above ({per_node} "
                   f"processes per node) and of a job whose nodes run {list(uneven_job)} processes, as torch's "
                   "own agents assign them.")


def _what_is_wrong(got: dict[tuple[int, int], Any], expected: dict[tuple[int, int], int], procs: list[int],
                   where: str) -> str:
    """The first mistake in `got` that a learner can act on, most telling first."""
    call = "global_rank({}, {}, " + str(procs) + ")"
    for (node, local), value in sorted(got.items()):
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            return f"{call.format(node, local)} returned {value!r} ({type(value).__name__}); RANK is a number."
    owners: dict[int, tuple[int, int]] = {}
    for (node, local), value in sorted(got.items()):
        if value in owners:
            first = owners[value]
            return (f"in {where}, two processes got RANK {value}: node {first[0]}'s local rank {first[1]} and node "
                    f"{node}'s local rank {local}. Every process of a job needs a RANK of its own.")
        owners[value] = (node, local)
    if got[0, 0] != 0:
        return (f"{call.format(0, 0)} returned {got[0, 0]}, but the job's first process (node 0, local rank 0) "
                "gets RANK 0: ranks count from 0.")
    for (node, local), value in sorted(got.items()):
        following = got.get((node, local + 1))
        if following is not None and following != value + 1:
            return (f"in {where}, node {node}'s local ranks {local} and {local + 1} got RANKs {value} and {following}. "
                    "torchrun gives the processes of one node consecutive ranks (look at the table from the run).")
    for (node, local), value in sorted(got.items()):
        if value != expected[node, local]:
            return (f"{call.format(node, local)} returned {value}, but torchrun gives RANK {expected[node, local]}. "
                    f"In {where}, each node's processes get consecutive ranks, node after node: which ranks do "
                    f"the nodes before node {node} take?")
    raise AssertionError("unreachable: got differs from expected")
