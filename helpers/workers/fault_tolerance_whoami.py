"""Which node, local rank and global rank is this process? Then one all_reduce across all nodes.

    # on each of two machines (node_rank 0 and 1), with HEAD = the first machine's address:
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 \
        --rdzv-id job1 helpers/workers/fault_tolerance_whoami.py

Works with any number of nodes and processes, on CPU (gloo) or GPUs (nccl).
"""
import os

import torch
import torch.distributed as dist

from helpers.worker import result


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    node_rank = int(os.environ["GROUP_RANK"])  # the node's rank, as the rendezvous assigned it
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")

    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)  # crosses the node boundary: every rank adds 0 + 1 + ... + world_size - 1
    print(f"node {node_rank} local rank {local_rank} -> global rank {rank} of {world_size}")
    result(node_rank=node_rank, local_rank=local_rank, rank=rank, world_size=world_size,
           nodes=int(os.environ["GROUP_WORLD_SIZE"]), rank_sum=total.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
