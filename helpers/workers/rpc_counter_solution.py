"""Exercise solution (lesson 05): a counter that lives on worker1, driven from worker0 through an RRef.

    torchrun --standalone --nproc-per-node 2 helpers/workers/rpc_counter_solution.py

worker0 creates the Counter on worker1 with rpc.remote, sends ten increments at once with
rpc_async through the RRef's proxy, waits for them, and reads the total with a remote method call.
With one process the counter lives on worker0 itself.
"""
import os
import threading
import warnings

import torch.distributed.rpc as rpc

from helpers.worker import result


class Counter:
    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()  # increments arrive on several RPC threads at once

    def add(self, amount: int) -> int:
        with self.lock:
            self.count += amount
            return self.count

    def value(self) -> int:
        return self.count


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch-internal deprecation
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        counter = rpc.remote(f"worker{1 % world_size}", Counter)
        futures = [counter.rpc_async().add(1) for _ in range(10)]
        partial_counts = [future.wait() for future in futures]  # what each add() returned
        result(count=counter.rpc_sync().value(), owner=counter.owner().name,
               partial_counts=sorted(partial_counts))
    rpc.shutdown()


if __name__ == "__main__":
    main()
