"""Rank 1 (or the rank given as the first argument) raises while every other rank waits in all_reduce."""
import sys
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == int((sys.argv[1:] or [1])[0]):
    time.sleep(0.2)
    raise ValueError(f"rank {dist.get_rank()} broke on purpose")
dist.all_reduce(torch.ones(3))
