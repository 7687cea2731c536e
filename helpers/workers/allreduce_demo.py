"""Every rank contributes a tensor; all_reduce sums them on every rank.

    torchrun --standalone --nproc-per-node 2 helpers/workers/allreduce_demo.py

Works with any number of processes, on CPU (gloo) or GPUs (nccl).
"""
import os

import torch
import torch.distributed as dist

from helpers.kit.reporting import result


def main() -> None:
    use_cuda = torch.cuda.is_available()
    dist.init_process_group(backend="nccl" if use_cuda else "gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}" if use_cuda else "cpu")

    tensor = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    print(f"rank {rank}/{world_size}: before {before.tolist()} after {tensor.tolist()}")
    result(before=before.cpu(), after=tensor.cpu(), world_size=world_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
