"""Who does torchrun say this process is? Then one all_reduce across every node (CPU: gloo; GPUs: nccl).

    torchrun --standalone --nproc-per-node 2 helpers/workers/whoami.py
    # two "nodes" on one machine (run both commands, in two terminals; --gloo: see below):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 \
        helpers/workers/whoami.py --gloo
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 \
        helpers/workers/whoami.py --gloo
    # on two machines, with HEAD = the first machine's address, run on each:
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HEAD:29500 --rdzv-id job1 \
        helpers/workers/whoami.py

--gloo: gloo and the CPU even where there are GPUs. Two "nodes" on one machine need it: each agent numbers its
processes from LOCAL_RANK 0, so both nodes' first processes would take GPU 0, and NCCL refuses two ranks on one GPU
(its "Duplicate GPU detected" error; not run here).
"""
import os
import sys

import torch
import torch.distributed as dist

from helpers.kit.reporting import result

NAMES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]


def main() -> None:
    me = {name: os.environ[name] for name in NAMES}
    print(" ".join(f"{name}={value}" for name, value in me.items() if name != "MASTER_PORT"))
    use_gpu = torch.cuda.is_available() and "--gloo" not in sys.argv[1:]  # one GPU per process: LOCAL_RANK picks it
    device = torch.device("cuda", int(me["LOCAL_RANK"])) if use_gpu else torch.device("cpu")
    if use_gpu:
        torch.cuda.set_device(device)
    # "env://" (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE); gloo waits here for all, nccl at the first collective
    dist.init_process_group("nccl" if use_gpu else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)  # crosses the node boundary: every rank adds 0 + 1 + ... + world_size - 1
    result(**me, node_rank=int(me["GROUP_RANK"]), local_rank=int(me["LOCAL_RANK"]), rank=rank,
           world_size=world_size, nodes=int(os.environ["GROUP_WORLD_SIZE"]), rank_sum=total.item())
    dist.destroy_process_group()  # leave the group: frees its connections before the process exits


if __name__ == "__main__":
    main()
