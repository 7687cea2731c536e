"""A parameter server with distributed autograd: trainers pull parameters and push gradients.

    torchrun --standalone --nproc-per-node 3 helpers/workers/rpc_parameter_server.py --steps 40

Rank 0 is the server ("ps"): it holds the only real copy of the model, and its main thread just
waits in rpc.shutdown() until the trainers are done, then tests the model. Every other rank is a
trainer ("trainer1", "trainer2", ...) that, each step, inside a distributed autograd context:
pulls the parameters (views of them: see ParameterServer.parameters), runs the model locally, calls
dist_autograd.backward (gradients travel back to the server, into that context only) and
DistributedOptimizer.step (the server applies them). Trainers never wait for each other: updates
are asynchronous. With one process the server trains alone.
"""
import argparse
import logging
import os
import threading
import time

import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
import torch.nn.functional as F
from torch.distributed.optim import DistributedOptimizer
from torch.func import functional_call

from helpers.kit.models import SimpleModel
from helpers.kit.reporting import progress, report, result
from helpers.kit.rpc import accuracy, start_rpc, trainer_batches, warnings_seen, worker_name

_server = None
_server_lock = threading.Lock()


class ParameterServer:
    """Owns the model. Trainers reach it through an RRef; its methods run on the server."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = SimpleModel()

    def parameters(self) -> list[torch.Tensor]:
        # Views, not the nn.Parameters themselves. The RPC pickler (torch/distributed/rpc/internal.py)
        # sends exactly torch.Tensor through distributed autograd; an nn.Parameter pickles itself with
        # Parameter.__reduce_ex__, which sends its detached .data: the trainer would get an unlinked
        # copy, and its gradients would never reach this server. A view is a plain tensor linked to p.
        return [p.view_as(p) for p in self.model.parameters()]

    def parameter_rrefs(self) -> list[rpc.RRef]:
        return [rpc.RRef(p) for p in self.model.parameters()]


def count_overlapping_steps() -> dict:
    """Server: wrap torch's remote optimizer step to count the steps that start while another one is running.

    DistributedOptimizer(torch.optim.SGD) runs _FunctionalLocalOptimizer.step on the server, on an RPC thread, with
    no lock (torch/distributed/optim/optimizer.py:26-34). The wrapper only counts; the step is torch's."""
    from torch.distributed.optim import optimizer as distributed_optimizer

    counts, lock = {"steps": 0, "running": 0, "overlapping": 0}, threading.Lock()
    torch_step = distributed_optimizer._FunctionalLocalOptimizer.step

    def step(self, autograd_ctx_id: int) -> None:
        with lock:
            counts["steps"] += 1
            counts["overlapping"] += counts["running"] > 0
            counts["running"] += 1
        try:
            torch_step(self, autograd_ctx_id)
        finally:
            with lock:
                counts["running"] -= 1

    distributed_optimizer._FunctionalLocalOptimizer.step = step
    return counts


def get_server() -> ParameterServer:
    """Run on the server by rpc.remote: every trainer gets an RRef to the same object."""
    global _server
    with _server_lock:  # two trainers may ask at once, each on its own RPC thread
        if _server is None:
            _server = ParameterServer()
        return _server


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    server = rpc.remote(worker_name(0), get_server)
    # Each DistributedOptimizer creates its own SGD on the server: with momentum, one buffer per trainer.
    optimizer = DistributedOptimizer(torch.optim.SGD, server.rpc_sync().parameter_rrefs(),
                                     lr=args.lr, momentum=args.momentum)
    shape_only = SimpleModel()  # its own parameters are never used: only its forward code
    names = [name for name, _ in shape_only.named_parameters()]
    trainer, trainers = max(rank - 1, 0), max(world_size - 1, 1)
    started = time.perf_counter()
    for step, (images, labels) in enumerate(trainer_batches(trainer, trainers, args.per_rank_batch, args.steps)):
        if rank == args.crash_rank and step == args.crash_step:
            raise RuntimeError(f"{worker_name(rank)} crashed at step {step} (simulated)")
        if rank == args.vanish_rank and step == args.crash_step:
            os._exit(0)  # gone without an error and without rpc.shutdown(): no agent would notice
        with dist_autograd.context() as context_id:
            parameters = server.rpc_sync().parameters()  # pull
            logits = functional_call(shape_only, dict(zip(names, parameters, strict=True)), (images,))
            loss = F.cross_entropy(logits, labels)
            dist_autograd.backward(context_id, [loss])  # push: gradients land on the server
            optimizer.step(context_id)  # the server updates its model with this context's gradients
        report(step=step, loss=loss.item())
        progress(step + 1, total=args.steps)
    result(steps=args.steps, seconds=time.perf_counter() - started)


def shutdown_with_timeout(seconds: float) -> None:
    """rpc.shutdown(timeout=seconds), and say how it ended. The error is caught so that every rank gets to report
    its own; left uncaught it would end the process, and torchrun's agent would stop the job at the first one."""
    logging.getLogger("torch.distributed.rpc.api").setLevel(logging.CRITICAL)  # the error is printed below instead
    started = time.perf_counter()
    try:
        rpc.shutdown(timeout=seconds)
        outcome = "returned"
    except Exception as error:  # which error it is, is what this run shows
        outcome = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
    waited = time.perf_counter() - started
    print(f"rpc.shutdown(timeout={seconds:g}) ended after {waited:.1f} s: {outcome}")
    result(shutdown_outcome=outcome, shutdown_seconds=waited)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps each trainer takes, in total")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0, help="0: SGD keeps no per-trainer state")
    parser.add_argument("--crash-rank", type=int, default=-1, help="this trainer raises (failure demo)")
    parser.add_argument("--vanish-rank", type=int, default=-1, help="this trainer exits silently, code 0")
    parser.add_argument("--crash-step", type=int, default=5, help="...at this step")
    parser.add_argument("--rpc-timeout", type=float, default=60.0, help="seconds a single RPC may take")
    parser.add_argument("--shutdown-timeout", type=float, default=0.0,
                        help="passed to rpc.shutdown(timeout=...); 0 is torch's default: no limit")
    args = parser.parse_args()
    rank, world_size = start_rpc(timeout=args.rpc_timeout)
    report(pid=os.getpid())  # the lesson checks that no process outlives a failed job
    step_counts = count_overlapping_steps() if rank == 0 else {}
    if rank != 0 or world_size == 1:
        train(rank, world_size, args)
    report(in_shutdown=True)  # the time stamp says when this rank began waiting in rpc.shutdown()
    if args.shutdown_timeout:
        shutdown_with_timeout(args.shutdown_timeout)
        return
    rpc.shutdown()  # the server waits here until every trainer has finished
    if rank == 0:
        result(test_accuracy=accuracy(get_server().model), warnings=warnings_seen(),
               optimizer_steps=step_counts["steps"], overlapping_steps=step_counts["overlapping"])


if __name__ == "__main__":
    main()
