"""Ring all-reduce written by hand with isend/irecv, checked against dist.all_reduce.

    torchrun --standalone --nproc-per-node 2 helpers/workers/collectives_ring.py --numel 1000000

The tensor is cut into world_size chunks. Phase 1 (reduce-scatter): in N-1 steps every rank sends
one chunk to its right neighbour and adds the chunk it receives from its left one; afterwards rank r
owns the full sum of chunk (r+1) % N. Phase 2 (all-gather): N-1 more steps pass the finished chunks
around the ring. Each rank sends 2(N-1)/N of the tensor in total, whatever N is: the ring's promise.
Bytes are counted twice, where they are sent: at every isend call, and by the operating system
(/proc/self/io on Linux), which also counts what dist.all_reduce itself writes. With nccl on GPUs the
bytes travel over NVLink/PCIe/InfiniBand, not through write calls, so the OS count says nothing there.
Any number of processes (one: nothing to send). gloo on every machine: isend/irecv can hang on nccl (lesson 01).
"""
import argparse
import time

import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result

bytes_sent = 0  # counted by `exchange`, at the isend call itself


def os_bytes_written() -> int | None:
    """Bytes this process asked the operating system to write so far (Linux /proc/self/io `wchar`: every
    thread's write/writev calls, which is how gloo's TCP transport sends), None where there is no such file."""
    try:
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))
    except (OSError, StopIteration):
        return None


def exchange(send: torch.Tensor, receive: torch.Tensor, rank: int, world_size: int) -> None:
    """Send to the right neighbour while receiving from the left one (non-blocking, so no deadlock)."""
    global bytes_sent
    send = send.contiguous()
    requests = [dist.isend(send, dst=(rank + 1) % world_size),
                dist.irecv(receive, src=(rank - 1) % world_size)]
    bytes_sent += send.numel() * send.element_size()  # what this isend put on the wire
    for request in requests:
        request.wait()


def ring_all_reduce(tensor: torch.Tensor, trace: list | None = None) -> None:
    """Sum `tensor` over all ranks in place, with 2(N-1) neighbour exchanges (`trace`: this rank's chunks after
    each step are appended to it, for the lesson's picture)."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    chunks = list(tensor.view(-1).tensor_split(world_size))  # views: writing them writes `tensor`
    incoming = torch.empty_like(chunks[0])
    for step in range(world_size - 1):  # phase 1: reduce-scatter
        send_index, receive_index = (rank - step) % world_size, (rank - step - 1) % world_size
        buffer = incoming[: chunks[receive_index].numel()]
        exchange(chunks[send_index], buffer, rank, world_size)
        chunks[receive_index] += buffer
        if trace is not None:
            trace.append([chunk.tolist() for chunk in chunks])
    for step in range(world_size - 1):  # phase 2: all-gather of the finished chunks
        send_index, receive_index = (rank + 1 - step) % world_size, (rank - step) % world_size
        buffer = incoming[: chunks[receive_index].numel()]
        exchange(chunks[send_index], buffer, rank, world_size)
        chunks[receive_index].copy_(buffer)
        if trace is not None:
            trace.append([chunk.tolist() for chunk in chunks])


def timed(function, tensor: torch.Tensor) -> tuple[float, int | None]:
    """Run function(tensor) after a barrier; return (seconds, bytes the OS was asked to write meanwhile)."""
    dist.barrier()
    written, started = os_bytes_written(), time.perf_counter()
    function(tensor)
    seconds, written_after = time.perf_counter() - started, os_bytes_written()
    return seconds, None if written is None else written_after - written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=1_000_003, help="elements (need not divide by N)")
    args = parser.parse_args()
    rank, world_size, device = init_distributed("gloo")  # CPU tensors on every machine: see the docstring

    torch.manual_seed(rank)  # different random data on every rank
    data = torch.randn(args.numel, device=device)
    by_hand, reference = data.clone(), data.clone()
    ring_seconds, ring_os_bytes = timed(ring_all_reduce, by_hand)
    library_seconds, library_os_bytes = timed(dist.all_reduce, reference)

    max_abs_diff = (by_hand - reference).abs().max().item()
    print(f"rank {rank}: max |ring - all_reduce| = {max_abs_diff:.2e}, sent {bytes_sent:,} bytes")
    sent = bytes_sent  # the picture's tiny ring below is not counted
    # for the picture: one number per chunk, 2**rank on this rank, so a sum says whose numbers are in it
    small = torch.full((world_size,), 2.0**rank, device=device)
    trace = [[chunk.tolist() for chunk in small.tensor_split(world_size)]]
    ring_all_reduce(small, trace)
    result(max_abs_diff=max_abs_diff, max_abs_value=reference.abs().max().item(), bytes_sent=sent, trace=trace,
           ring_os_bytes=ring_os_bytes, library_os_bytes=library_os_bytes,
           tensor_bytes=data.numel() * data.element_size(), world_size=world_size,
           ring_seconds=ring_seconds, library_seconds=library_seconds, backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
