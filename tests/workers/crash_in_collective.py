"""Rank 1 raises while every other rank waits in all_reduce."""
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.2)
    raise ValueError("rank 1 broke on purpose")
dist.all_reduce(torch.ones(3))
