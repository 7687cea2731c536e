"""RPC in five calls: rpc_sync, rpc_async, remote, RRef.to_here, RRef.local_value, then shutdown.

    torchrun --standalone --nproc-per-node 2 helpers/workers/rpc_basics.py

Rank 0 ("worker0") drives; rank 1 ("worker1") only serves: its main thread goes straight to
rpc.shutdown(), which waits until every peer is done with it. Runs on CPU (TensorPipe). Needs two
processes: on its owner `to_here()` returns the object itself, not a copy, so with one process (worker0
calling itself) the copy below would be the owner's tensor.
"""
import gc
import os
import time
import warnings

import torch
import torch.distributed.rpc as rpc
from torch._C._distributed_rpc import _rref_context_get_debug_info

from helpers.kit.reporting import result


def whoami(x: torch.Tensor) -> str:
    """Runs on the callee: the function travels by name, its arguments by value (pickled)."""
    return f"{rpc.get_worker_info().name} received {x.tolist()}"


def slow_square(x: int) -> int:
    time.sleep(0.2)  # stands in for real work, so that overlapping calls show
    return x * x


def double_in_place(rref: rpc.RRef) -> None:
    """Runs on the owner, where local_value() is the object itself, not a copy."""
    rref.local_value().mul_(2)


def to_here_is_local_value(rref: rpc.RRef) -> bool:
    """Runs on the owner: there to_here() hands back the object itself, not a copy."""
    return rref.to_here() is rref.local_value()


def owner_rrefs() -> int:
    """Runs on the owner: how many objects its RRef context keeps alive for remote users."""
    return int(_rref_context_get_debug_info()["num_owner_rrefs"])


def owner_rrefs_after_release(callee: str, held: int, seconds: float = 5.0) -> int:
    """Poll the owner until its count drops below `held` (the user's delete message is asynchronous)."""
    deadline = time.perf_counter() + seconds
    while (count := rpc.rpc_sync(callee, owner_rrefs)) >= held and time.perf_counter() < deadline:
        time.sleep(0.05)
    return count


def drive(callee: str) -> dict:
    facts = {"sync": rpc.rpc_sync(callee, whoami, args=(torch.arange(3),))}
    facts["builtin"] = rpc.rpc_sync(callee, torch.add, args=(torch.ones(2), 1)).tolist()

    started = time.perf_counter()
    futures = [rpc.rpc_async(callee, slow_square, args=(i,)) for i in range(4)]  # all in flight at once
    facts["async"] = [future.wait() for future in futures]
    facts["async_seconds"] = time.perf_counter() - started

    rref = rpc.remote(callee, torch.ones, args=((2, 2),))  # created and kept on the callee
    facts["owner"], facts["is_owner"] = rref.owner().name, rref.is_owner()
    copy = rref.to_here()  # a copy travels back
    copy.add_(100)  # changes the copy only
    facts["to_here_on_owner_is_the_object"] = rpc.rpc_sync(callee, to_here_is_local_value, args=(rref,))
    rpc.rpc_sync(rref.owner(), double_in_place, args=(rref,))
    facts["after_double"] = rref.to_here().tolist()
    facts["remote_sum"] = rref.rpc_sync().sum().item()  # a method run by the owner: no copy of the tensor

    # The owner keeps the object alive while any user holds an RRef to it; dropping the last one sends the
    # owner a delete message (torch/csrc/distributed/rpc/rref_context.h, RRefContext::delForkOfOwner).
    facts["owner_rrefs_while_held"] = rpc.rpc_sync(callee, owner_rrefs)
    del rref
    gc.collect()
    facts["owner_rrefs_after_del"] = owner_rrefs_after_release(callee, facts["owner_rrefs_while_held"])
    return facts


def main() -> None:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size != 2:
        raise SystemExit(f"rpc_basics.py needs exactly 2 processes (--nproc-per-node 2), got {world_size}")
    warnings.filterwarnings("ignore", message="You are using a Backend")  # torch-internal deprecation
    # Names are the addresses; MASTER_ADDR and MASTER_PORT (set by torchrun) are where peers meet.
    rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world_size)
    if rank == 0:
        facts = drive(callee="worker1")
        for key, value in facts.items():
            print(f"{key}: {value}")
        result(**facts)
    started = time.perf_counter()
    rpc.shutdown()  # graceful: a barrier that waits for every peer's outstanding work
    print(f"worker{rank}: rpc.shutdown() returned after {time.perf_counter() - started:.2f} s")
    result(shutdown_seconds=time.perf_counter() - started)


if __name__ == "__main__":
    main()
