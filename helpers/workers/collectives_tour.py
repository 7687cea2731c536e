"""Every collective once: each rank records its tensor before and after, for the lesson's pictures.

    torchrun --standalone --nproc-per-node 4 helpers/workers/collectives_tour.py

Rank r starts from [10r+1, 10r+2, ...] so that every number says which rank it came from.
Works with any number of processes, on CPU (gloo) or GPUs (nccl). Under helpers.launch each rank
hands back {operation: {"before": [...], "after": [...]}} plus the barrier's arrival/leave times.
"""
import os
import time

import torch
import torch.distributed as dist

from helpers.worker import result


def starting_tensor(rank: int, length: int, device: torch.device) -> torch.Tensor:
    """[10r+1, 10r+2, ...]: the tens digit names the rank that owns the number."""
    return torch.arange(1, length + 1, dtype=torch.float32, device=device) + 10 * rank


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")
    length = 4 if 4 % world_size == 0 else world_size  # reduce_scatter needs equal chunks
    seen: dict[str, dict[str, list]] = {}

    def record(name: str, before: torch.Tensor, after: torch.Tensor) -> None:
        seen[name] = {"before": before.cpu().tolist(), "after": after.cpu().tolist()}

    # send/recv: blocking point-to-point, rank 0 -> rank 1; everyone else just watches
    tensor = starting_tensor(rank, length, device)
    before = tensor.clone()
    if world_size > 1 and rank == 0:
        dist.send(tensor, dst=1)
    elif world_size > 1 and rank == 1:
        dist.recv(tensor, src=0)
    record("send/recv", before, tensor)

    # isend/irecv: every rank passes to its right neighbour at the same time (a ring shift).
    # With blocking send on both sides each rank could wait for the other: non-blocking ops avoid that.
    tensor = starting_tensor(rank, length, device)
    received = torch.empty_like(tensor)
    requests = [dist.isend(tensor, dst=(rank + 1) % world_size),
                dist.irecv(received, src=(rank - 1) % world_size)]
    for request in requests:
        request.wait()
    record("isend/irecv", tensor, received)

    tensor = starting_tensor(rank, length, device)
    before = tensor.clone()
    dist.broadcast(tensor, src=0)
    record("broadcast", before, tensor)

    # reduce: only rank 0 (dst) is promised the sum; what other ranks hold afterwards is unspecified
    tensor = starting_tensor(rank, length, device)
    before = tensor.clone()
    dist.reduce(tensor, dst=0, op=dist.ReduceOp.SUM)
    record("reduce", before, tensor)

    tensor = starting_tensor(rank, length, device)
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    record("all_reduce", before, tensor)

    # reduce_scatter: sum everything, but rank r keeps only chunk r of the sum
    tensor = starting_tensor(rank, length, device)
    chunk = torch.empty(length // world_size, device=device)
    dist.reduce_scatter(chunk, list(tensor.chunk(world_size)), op=dist.ReduceOp.SUM)
    record("reduce_scatter", tensor, chunk)

    # all_gather of those chunks: every rank gets every chunk, i.e. the all_reduce result
    pieces = [torch.empty_like(chunk) for _ in range(world_size)]
    dist.all_gather(pieces, chunk)
    record("all_gather", chunk, torch.cat(pieces))

    # barrier: ranks arrive at different times and nobody leaves before the last one arrives
    dist.barrier()
    time.sleep(0.15 * rank)
    arrived = time.time()
    dist.barrier()
    left = time.time()
    result(tensors=seen, barrier={"arrived": arrived, "left": left}, world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
