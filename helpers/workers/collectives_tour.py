"""Every collective once: each rank records its tensor before and after, for the lesson's pictures.

    torchrun --standalone --nproc-per-node 4 helpers/workers/collectives_tour.py

Rank r starts from [10r+1, 10r+2, ...] so that every number says which rank it came from.
Works with any number of processes, on CPU (gloo) or GPUs (nccl). Under helpers.launch each rank
hands back {operation: {"before": [...], "after": [...]}} (for gather also "input after": the tensor a
rank sent, read after the call), the barrier's arrival/leave times,
what the non-blocking (async_op=True) all_reduce's work handle said, and the backend's name.
Every rank makes the same calls in the same order with matching shapes: the first rule of collectives.
"""
import time

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, result

LATE_SECONDS = 0.3  # in the async demo the last rank joins this late, so nobody can finish before


def starting_tensor(rank: int, length: int, device: torch.device) -> torch.Tensor:
    """[10r+1, 10r+2, ...]: the tens digit names the rank that owns the number."""
    return torch.arange(1, length + 1, dtype=torch.float32, device=device) + 10 * rank


def non_blocking_all_reduce(tensor: torch.Tensor, rank: int, world_size: int) -> dict:
    """all_reduce(async_op=True) returns a work handle at once; the sum is there only after wait()."""
    if rank == world_size - 1:
        time.sleep(LATE_SECONDS)  # the last rank is late: the others' all_reduce cannot be done yet
    started = time.perf_counter()
    work = dist.all_reduce(tensor, async_op=True)
    returned = time.perf_counter()
    done_at_return = work.is_completed()
    other = torch.randn(256, 256, device=tensor.device)
    other @ other  # this rank is free to compute while the all_reduce is in flight
    work.wait()  # from here on `tensor` holds the sum (on GPUs: the current stream waits for it)
    return {"call_seconds": returned - started, "wait_seconds": time.perf_counter() - returned,
            "completed_at_return": done_at_return, "completed_after_wait": work.is_completed(),
            "late": rank == world_size - 1}


def main() -> None:
    rank, world_size, device = init_distributed()
    length = 4 if 4 % world_size == 0 else world_size  # reduce_scatter and all_to_all need equal chunks
    seen: dict[str, dict[str, list]] = {}
    steps = 17  # one progress tick per operation below

    def record(name: str, before: torch.Tensor | None, after: torch.Tensor | None) -> None:
        """None: this rank has nothing there (e.g. no output on a rank that is not dst)."""
        seen[name] = {"before": [] if before is None else before.cpu().tolist(),
                      "after": [] if after is None else after.cpu().tolist()}
        progress(len(seen), total=steps)

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
    received = tensor.clone()  # one process: its own left neighbour
    if world_size > 1:
        # isend right, irecv left; on nccl as one batch_isend_irecv (ring_shift, below the main function)
        requests = ring_shift(tensor, received, rank, world_size)
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

    # scatter: rank 0 cuts its tensor into world_size chunks and rank r receives chunk r
    tensor = starting_tensor(rank, length, device)
    piece = torch.empty(length // world_size, device=device)
    dist.scatter(piece, list(tensor.chunk(world_size)) if rank == 0 else None, src=0)
    record("scatter", tensor if rank == 0 else None, piece)

    # gather: every rank's tensor lands on rank 0, in rank order. gather_list must be given on dst and must be
    # None (or empty) on every other rank (torch raises ValueError otherwise): those ranks have no output
    tensor = starting_tensor(rank, length, device)
    sent = tensor.clone()
    pieces = [torch.empty_like(tensor) for _ in range(world_size)] if rank == 0 else None
    dist.gather(tensor, pieces, dst=0)
    record("gather", sent, torch.cat(pieces) if rank == 0 else None)
    seen["gather"]["input after"] = tensor.cpu().tolist()  # a rank's input tensor after it was sent

    # all_to_all: rank r sends its chunk j to rank j and receives chunk r of every rank (a transpose)
    tensor = starting_tensor(rank, length, device)
    incoming = [torch.empty(length // world_size, device=device) for _ in range(world_size)]
    dist.all_to_all(incoming, list(tensor.chunk(world_size)))
    record("all_to_all", tensor, torch.cat(incoming))

    # reduce_scatter: sum everything, but rank r keeps only chunk r of the sum
    tensor = starting_tensor(rank, length, device)
    chunk = torch.empty(length // world_size, device=device)
    dist.reduce_scatter(chunk, list(tensor.chunk(world_size)), op=dist.ReduceOp.SUM)
    record("reduce_scatter", tensor, chunk)

    # all_gather of those chunks: every rank gets every chunk, i.e. the all_reduce result
    pieces = [torch.empty_like(chunk) for _ in range(world_size)]
    dist.all_gather(pieces, chunk)
    record("all_gather", chunk, torch.cat(pieces))

    # the same two steps on one flat tensor each (what FSDP calls): no list of pieces to allocate or copy.
    # torch 2.14 names them *_single; all_gather_into_tensor and reduce_scatter_tensor are their deprecated names
    tensor = starting_tensor(rank, length, device)
    chunk = torch.empty(length // world_size, device=device)
    dist.reduce_scatter_single(chunk, tensor)
    record("reduce_scatter_single", tensor, chunk)
    flat = torch.empty(length, device=device)
    dist.all_gather_single(flat, chunk)
    record("all_gather_single", chunk, flat)

    # AVG: the sum divided by the number of ranks, in one call. 8 numbers, not world_size of them, so that an
    # AVG that divided by the tensor's length instead of the number of ranks would give a different answer
    tensor = starting_tensor(rank, 8, device)
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.AVG)
    record("all_reduce(op=AVG)", before, tensor)

    # AVG in float16 near its largest value (65504): every rank holds 40000. gloo's AVG sums first, then divides
    # (the sum, 40000 * N, overflows to inf); dividing by N first and then summing stays finite
    large = torch.full((2,), 40000.0, dtype=torch.float16, device=device)
    averaged = large.clone()
    dist.all_reduce(averaged, op=dist.ReduceOp.AVG)
    divided_first = large.clone().div_(world_size)
    dist.all_reduce(divided_first, op=dist.ReduceOp.SUM)
    record("fp16 all_reduce(op=AVG)", large, averaged)
    record("fp16 divide by N, then SUM", large, divided_first)

    # AVG on integers: gloo (torch 2.14.1) sums and then cannot divide in place; nccl averages integers
    integers = torch.arange(1, 3, dtype=torch.int64, device=device) + 10 * rank
    try:
        dist.all_reduce(integers, op=dist.ReduceOp.AVG)
        integer_avg = {"after": integers.cpu().tolist()}
    except RuntimeError as error:
        integer_avg = {"error": str(error).splitlines()[0]}
    progress(len(seen), total=steps)

    # DDP on float16 gradients of 40000 on every rank: its reducer divides each gradient by N as it copies it
    # into the bucket, then all-reduces with SUM, so the averaged gradient is 40000, not inf
    weight_model = torch.nn.Linear(2, 1, bias=False).to(device=device, dtype=torch.float16)
    ddp = torch.nn.parallel.DistributedDataParallel(weight_model)
    with torch.no_grad():
        weight_model.weight.fill_(1.0)
    ddp(torch.full((1, 2), 40000.0, dtype=torch.float16, device=device)).sum().backward()
    ddp_gradient = weight_model.weight.grad.flatten().cpu().tolist()
    del ddp
    progress(len(seen), total=steps)

    # subgroups: by default (use_local_synchronization=False) every rank must create every group, in the same
    # order, even the groups it is not in;
    # then each rank all-reduces within its own half of the ranks only
    halves = [list(range(0, (world_size + 1) // 2)), list(range((world_size + 1) // 2, world_size))]
    groups = [dist.new_group(members) if members else None for members in halves]
    tensor = starting_tensor(rank, length, device)
    before = tensor.clone()
    dist.all_reduce(tensor, group=groups[0] if rank in halves[0] else groups[1])
    record("all_reduce in a subgroup", before, tensor)

    tensor = starting_tensor(rank, length, device)
    before = tensor.clone()
    handle = non_blocking_all_reduce(tensor, rank, world_size)
    record("all_reduce(async_op=True)", before, tensor)

    # barrier: ranks arrive at different times and nobody leaves before the last one arrives
    dist.barrier()
    time.sleep(0.15 * rank)
    arrived = time.time()
    dist.barrier()
    left = time.time()
    progress(steps, total=steps)
    result(tensors=seen, barrier={"arrived": arrived, "left": left}, work_handle=handle, world_size=world_size,
           integer_avg=integer_avg, ddp_fp16_gradient=ddp_gradient,
           backend=dist.get_backend(), subgroups=halves)
    dist.destroy_process_group()


def ring_shift(tensor: torch.Tensor, received: torch.Tensor, rank: int, world_size: int) -> list:
    """Send `tensor` to the right neighbour and receive the left one's into `received`; the requests to wait on. On
    nccl the two go as one batch_isend_irecv: separate isend/irecv calls can hang there (lesson 01; not run here)."""
    right, left = (rank + 1) % world_size, (rank - 1) % world_size
    if dist.get_backend() == "nccl":
        return dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, right), dist.P2POp(dist.irecv, received, left)])
    return [dist.isend(tensor, dst=right), dist.irecv(received, src=left)]


if __name__ == "__main__":
    main()
