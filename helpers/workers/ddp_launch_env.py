"""What a worker script receives from the deprecated torch.distributed.launch, and from torchrun.

    python -m torch.distributed.launch --nproc-per-node 1 helpers/workers/ddp_launch_env.py  # FutureWarning
    torchrun --nproc-per-node 1 helpers/workers/ddp_launch_env.py

torch.distributed.launch (torch/distributed/launch.py) is torchrun plus one legacy default: unless
given --use-env it appends --local-rank=N to the script's arguments (config_from_args in
torch/distributed/run.py), so old scripts had to parse it. torchrun passes nothing: read LOCAL_RANK.
"""
import os
import sys

print(f"arguments: {sys.argv[1:]}, LOCAL_RANK in the environment: {os.environ.get('LOCAL_RANK')}")
