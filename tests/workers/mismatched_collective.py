"""Rank 0 all-reduces 3 numbers, rank 1 all-reduces 4: a bug that TORCH_DISTRIBUTED_DEBUG=DETAIL names."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(3 + dist.get_rank()))
