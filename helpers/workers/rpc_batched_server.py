"""A parameter server that applies updates in batches, with @rpc.functions.async_execution.

    torchrun --standalone --nproc-per-node 3 helpers/workers/rpc_batched_server.py --steps 40

Rank 0 is the server ("ps"); the other ranks are trainers that compute gradients on their own copy
of the model and send them with one RPC per step. The server's update_and_fetch_model returns a
Future at once, freeing its RPC thread; when every trainer's gradients have arrived it averages
them, takes one optimizer step and completes the Future, which sends the new model back to every
waiting trainer. Updates are synchronous: each step waits for the slowest trainer. With
--round-size 1 every push is applied at once and answered at once: asynchronous, like
rpc_parameter_server.py, but with one RPC per step instead of three.
"""
import argparse
import threading
import time

import torch
import torch.distributed.rpc as rpc
import torch.nn.functional as F

from helpers.kit.models import SimpleModel
from helpers.kit.reporting import progress, report, result
from helpers.kit.rpc import accuracy, start_rpc, trainer_batches, worker_name

_server = None
_server_lock = threading.Lock()


class BatchUpdateParameterServer:
    """Owns the model; collects `batch_updates` gradient pushes per optimizer step (their mean)."""

    def __init__(self, batch_updates: int, lr: float, momentum: float) -> None:
        torch.manual_seed(0)
        self.model = SimpleModel()
        for p in self.model.parameters():
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=momentum)
        self.batch_updates, self.arrived = batch_updates, 0
        self.lock = threading.Lock()  # pushes arrive on several RPC threads at once
        self.next_model = torch.futures.Future()
        self.optimizer_steps = 0

    def get_model(self) -> torch.nn.Module:
        return self.model  # pickled: the trainer gets a copy

    @staticmethod
    @rpc.functions.async_execution
    def update_and_fetch_model(server_rref: rpc.RRef, grads: list[torch.Tensor]) -> torch.futures.Future:
        self = server_rref.local_value()
        with self.lock:
            for p, grad in zip(self.model.parameters(), grads, strict=True):
                p.grad += grad
            self.arrived += 1
            future = self.next_model
            if self.arrived == self.batch_updates:
                for p in self.model.parameters():
                    p.grad /= self.batch_updates
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=False)
                self.optimizer_steps += 1
                self.arrived, self.next_model = 0, torch.futures.Future()
                future.set_result(self.model)  # answers every trainer that waited for this batch
        return future


def get_server(batch_updates: int, lr: float, momentum: float) -> BatchUpdateParameterServer:
    """Run on the server by rpc.remote: every trainer gets an RRef to the same object."""
    global _server
    with _server_lock:
        if _server is None:
            _server = BatchUpdateParameterServer(batch_updates, lr, momentum)
        return _server


def train(rank: int, world_size: int, args: argparse.Namespace) -> None:
    trainers = max(world_size - 1, 1)
    round_size = args.round_size or trainers
    server = rpc.remote(worker_name(0), get_server, args=(round_size, args.lr, args.momentum))
    model = server.rpc_sync().get_model()  # a method call on the server's object, via the RRef
    started = time.perf_counter()
    batches = trainer_batches(max(rank - 1, 0), trainers, args.per_rank_batch, args.steps)
    for step, (images, labels) in enumerate(batches):
        model.zero_grad()
        loss = F.cross_entropy(model(images), labels)
        loss.backward()
        grads = [p.grad for p in model.parameters()]
        model = rpc.rpc_sync(server.owner(), BatchUpdateParameterServer.update_and_fetch_model,
                             args=(server, grads))
        report(step=step, loss=loss.item())
        progress(step + 1, total=args.steps)
    result(steps=args.steps, seconds=time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="steps each trainer takes, in total")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--momentum", type=float, default=0.0)
    parser.add_argument("--round-size", type=int, default=0,
                        help="pushes per optimizer step; 0: one from every trainer (synchronous); 1: asynchronous")
    args = parser.parse_args()
    rank, world_size = start_rpc()
    if rank != 0 or world_size == 1:
        train(rank, world_size, args)
    rpc.shutdown()
    if rank == 0:
        result(test_accuracy=accuracy(_server.model), optimizer_steps=_server.optimizer_steps)


if __name__ == "__main__":
    main()
