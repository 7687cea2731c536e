"""Solution to lesson 01's exercise: all_gather built from point-to-point messages.

    torchrun --standalone --nproc-per-node 3 helpers/workers/collectives_all_gather_solution.py

Every rank posts a non-blocking send of its tensor to every other rank and a non-blocking receive
from each of them, then waits for all of them. Blocking send/recv in a loop could deadlock: two
ranks that both start with `send` would each wait for the other to receive.
Any number of processes. It joins gloo on every machine, with CPU tensors: separate isend/irecv calls can hang on
nccl, where the form is dist.batch_isend_irecv (lesson 01).
"""
import torch
import torch.distributed as dist

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result


def all_gather_by_hand(tensor: torch.Tensor) -> list[torch.Tensor]:
    """[rank 0's tensor, rank 1's tensor, ...] on every rank, using only isend/irecv."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered = [torch.empty_like(tensor) for _ in range(world_size)]
    gathered[rank] = tensor.clone()
    requests = []
    for other in range(world_size):
        if other != rank:
            requests.append(dist.isend(tensor, dst=other))
            requests.append(dist.irecv(gathered[other], src=other))
    for request in requests:
        request.wait()
    return gathered


def main() -> None:
    rank, _, device = init_distributed("gloo")  # gloo on every machine: see the docstring
    mine = torch.arange(3, dtype=torch.float32, device=device) + 10 * rank
    result(gathered=[piece.cpu().tolist() for piece in all_gather_by_hand(mine)])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
