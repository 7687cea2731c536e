"""Rank 1 passes a shorter tensor to all_reduce than rank 0: gloo's size check aborts a process (no traceback)."""
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
shard = torch.ones(9 if dist.get_rank() == 0 else 8)
dist.all_reduce(shard)  # the line the diagnosis must name
