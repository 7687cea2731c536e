"""Who does torchrun say this process is? Then one all_reduce that crosses every node.

    torchrun --standalone --nproc-per-node 2 helpers/workers/whoami.py
    # two "nodes" on one machine (run both commands, in two terminals):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 helpers/workers/whoami.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 helpers/workers/whoami.py
    # on two machines, with HEAD = the first machine's address, run on each:
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 --rdzv-id job1 \
        helpers/workers/whoami.py

Works with any number of nodes and processes, on CPU (gloo) or GPUs (nccl).
"""
import os

import torch
import torch.distributed as dist

from helpers.distributed import init_distributed
from helpers.reporting import result

NAMES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]


def main() -> None:
    me = {name: os.environ[name] for name in NAMES}
    print(" ".join(f"{name}={value}" for name, value in me.items() if name != "MASTER_PORT"))
    rank, world_size, device = init_distributed()
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)  # crosses the node boundary: every rank adds 0 + 1 + ... + world_size - 1
    result(**me, HELPERS_NODE=os.environ.get("HELPERS_NODE", me["GROUP_RANK"]),
           node_rank=int(me["GROUP_RANK"]), local_rank=int(me["LOCAL_RANK"]), rank=rank, world_size=world_size,
           nodes=int(os.environ["GROUP_WORLD_SIZE"]), rank_sum=total.item())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
