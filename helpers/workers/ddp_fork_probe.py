"""Does asking torch about GPUs make a later fork unsafe for CUDA? Ask, fork, and let the child try CUDA (lesson 02).

    python helpers/workers/ddp_fork_probe.py nothing          # the parent asks nothing before it forks
    python helpers/workers/ddp_fork_probe.py is_available     # the parent calls torch.cuda.is_available()
    python helpers/workers/ddp_fork_probe.py device_count     # the parent calls torch.cuda.device_count()

The parent does what its argument says, forks, and the child calls torch.cuda.init() and prints what happened, in
one line: "child: CUDA initialised", or the error's type and first sentence. No GPU is needed: on a machine
without one, the child's error says whether it failed for that reason or because the fork was poisoned. Last, the
parent prints whether NVIDIA's management library (NVML) could count the GPUs here ("nvml counted: yes" or "no"):
device_count() asks NVML first and poisons the fork only when NVML cannot answer.
"""
import os
import sys

import torch

asked = sys.argv[1] if len(sys.argv) > 1 else "nothing"
if asked == "is_available":
    torch.cuda.is_available()
elif asked == "device_count":
    torch.cuda.device_count()
elif asked != "nothing":
    raise SystemExit(f"unknown question {asked!r}: nothing, is_available or device_count")
child = os.fork()
if child == 0:  # the forked child
    try:
        torch.cuda.init()
        print("child: CUDA initialised", flush=True)
    except (RuntimeError, AssertionError) as error:
        print(f"child: {type(error).__name__}: {str(error).split('. ')[0]}", flush=True)
    os._exit(0)
os.waitpid(child, 0)
# NVML's count, asked only now (it never poisons a fork): negative when NVML could not answer
counted = getattr(torch.cuda, "_device_count_nvml", lambda: -1)()
print(f"nvml counted: {'yes' if counted >= 0 else 'no'}", flush=True)
