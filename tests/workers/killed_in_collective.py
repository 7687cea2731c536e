"""Rank 1 is killed by SIGKILL (as the OOM killer would) while rank 0 waits in all_reduce."""
import os
import signal
import time

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == 1:
    time.sleep(0.2)
    os.kill(os.getpid(), signal.SIGKILL)
dist.all_reduce(torch.ones(3))
