"""Ring all-reduce written by hand with isend/irecv, checked against dist.all_reduce.

    torchrun --standalone --nproc-per-node 2 helpers/workers/collectives_ring.py --numel 1000000

The tensor is cut into world_size chunks. Phase 1 (reduce-scatter): in N-1 steps every rank sends
one chunk to its right neighbour and adds the chunk it receives from its left one; afterwards rank r
owns the full sum of chunk (r+1) % N. Phase 2 (all-gather): N-1 more steps pass the finished chunks
around the ring. Each rank sends 2(N-1)/N of the tensor in total, whatever N is: the ring's promise.
Works with any number of processes (one process: nothing to send), on CPU (gloo) or GPUs (nccl).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist

from helpers.worker import result


def exchange(send: torch.Tensor, receive: torch.Tensor, rank: int, world_size: int) -> None:
    """Send to the right neighbour while receiving from the left one (non-blocking, so no deadlock)."""
    requests = [dist.isend(send.contiguous(), dst=(rank + 1) % world_size),
                dist.irecv(receive, src=(rank - 1) % world_size)]
    for request in requests:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor) -> int:
    """Sum `tensor` over all ranks in place; return how many bytes this rank sent."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world_size))  # views: writing them writes `tensor`
    incoming = torch.empty_like(chunks[0])
    bytes_sent = 0
    for step in range(world_size - 1):  # phase 1: reduce-scatter
        send_index, receive_index = (rank - step) % world_size, (rank - step - 1) % world_size
        buffer = incoming[: chunks[receive_index].numel()]
        exchange(chunks[send_index], buffer, rank, world_size)
        chunks[receive_index] += buffer
        bytes_sent += chunks[send_index].numel() * tensor.element_size()
    for step in range(world_size - 1):  # phase 2: all-gather of the finished chunks
        send_index, receive_index = (rank + 1 - step) % world_size, (rank - step) % world_size
        buffer = incoming[: chunks[receive_index].numel()]
        exchange(chunks[send_index], buffer, rank, world_size)
        chunks[receive_index].copy_(buffer)
        bytes_sent += chunks[send_index].numel() * tensor.element_size()
    return bytes_sent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1_000_003, help="elements (need not divide by N)")
    args = parser.parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")

    torch.manual_seed(rank)  # different random data on every rank
    data = torch.randn(args.numel, device=device)
    by_hand, reference = data.clone(), data.clone()

    dist.barrier()
    started = time.perf_counter()
    bytes_sent = ring_all_reduce(by_hand)
    ring_seconds = time.perf_counter() - started
    dist.barrier()
    started = time.perf_counter()
    dist.all_reduce(reference)
    library_seconds = time.perf_counter() - started

    max_abs_diff = (by_hand - reference).abs().max().item()
    print(f"rank {rank}: max |ring - all_reduce| = {max_abs_diff:.2e}, sent {bytes_sent:,} bytes")
    result(max_abs_diff=max_abs_diff, max_abs_value=reference.abs().max().item(), bytes_sent=bytes_sent,
           tensor_bytes=data.numel() * data.element_size(), world_size=world_size,
           ring_seconds=ring_seconds, library_seconds=library_seconds)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
