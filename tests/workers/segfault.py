"""Rank 1 dies of a segfault in its own code; rank 0 waits in a barrier."""
import ctypes
import os

import torch.distributed as dist

dist.init_process_group("gloo")
if int(os.environ["RANK"]) == 1:
    ctypes.string_at(0)  # the line the diagnosis must name
dist.barrier()
