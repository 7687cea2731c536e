"""A hang: rank 0 waits in all_reduce for a rank 1 that sleeps instead. Prints 'hanging' once there.
With --ignore-sigterm every rank also ignores SIGTERM (the launcher must still stop it)."""
import signal
import sys
import time

import torch
import torch.distributed as dist

from helpers.kit.reporting import report

if "--ignore-sigterm" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.init_process_group("gloo")
for step in range(3):
    dist.all_reduce(torch.ones(1))
    report(step=step)
print("hanging", flush=True)
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(1))  # waits for rank 1 forever (gloo's default timeout is 30 minutes)
else:
    time.sleep(120)
