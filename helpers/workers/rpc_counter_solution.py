"""Exercise solution (lesson 05): a counter that lives on worker1, driven from worker0 through an RRef.

    torchrun --standalone --nproc-per-node 2 helpers/workers/rpc_counter_solution.py

worker0 creates the Counter on worker1 with rpc.remote, sends ten increments at once with
rpc_async through the RRef's proxy, waits for them, and reads the total with a remote method call.
worker1's RPC threads run the ten add() calls at the same time, so the read-modify-write in add()
needs a lock; the lock covers the read and the write only, not the slow work before them, or the
calls would run one after another again. With one process the counter lives on worker0 itself.
"""
import os
import threading
import time
import warnings

import torch.distributed.rpc as rpc

from helpers.kit.reporting import result


class Counter:
    def __init__(self) -> None:
        self.count = 0
        self.home = rpc.get_worker_info().name  # the worker this object was created on
        self.lock = threading.Lock()  # add() calls arrive on several RPC threads at once

    def add(self, amount: int) -> int:
        time.sleep(0.1)  # slow work that may run in parallel with other calls
        with self.lock:  # without it, calls running at once read the same count and lose updates
            current = self.count
            time.sleep(0.01)
            self.count = current + amount
            return self.count

    def value(self) -> int:
        return self.count

    def where(self) -> str:
        return self.home


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch-internal deprecation
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        counter = rpc.remote(f"worker{1 % world_size}", Counter)  # created and kept on worker1
        started = time.perf_counter()
        futures = [counter.rpc_async().add(1) for _ in range(10)]  # all ten in flight at once
        partial_counts = [future.wait() for future in futures]  # what each add() returned
        seconds = time.perf_counter() - started
        result(count=counter.rpc_sync().value(), owner=counter.rpc_sync().where(),
               partial_counts=sorted(partial_counts), seconds=seconds)
    rpc.shutdown()


if __name__ == "__main__":
    main()
