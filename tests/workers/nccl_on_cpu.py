"""Asks for nccl on a machine that may have no GPU."""
import torch.distributed as dist

dist.init_process_group("nccl")
