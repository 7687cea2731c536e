"""Save and load a checkpoint under DDP: one writer, a barrier, map_location, and the "module." prefix (lesson 02).

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_checkpoint.py --path /tmp/ddp_checkpoint.pt

Trains 3 DDP steps, then: rank 0 alone saves the wrapped model's own state_dict (`ddp.module.state_dict()`, whose
keys have no "module." prefix); every rank waits at a barrier until the file is complete, then loads it with
map_location set to its own device (a tensor saved from cuda:0 would otherwise come back on cuda:0 on every rank)
into a fresh, unwrapped model, and compares. It also loads the wrapper's state_dict into an unwrapped model with
strict=False, which lists the keys that do not match (strict=True, the default, raises on them). Lesson 06 adds what
a real checkpoint needs: an atomic write, the optimizer and RNG state, and resuming.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.models import build_model
from helpers.kit.reporting import result
from helpers.kit.tensors import max_abs_diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", required=True)
    args = parser.parse_args()
    rank, _, device = init_distributed()
    torch.manual_seed(0)
    ddp = DDP(build_model("simple").to(device))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        images, labels = torch.rand(8, 1, 28, 28, device=device), torch.randint(0, 10, (8,), device=device)
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(images), labels).backward()
        optimizer.step()

    if rank == 0:  # one writer: every rank holds the same weights, and N writers to one file can corrupt it
        torch.save(ddp.module.state_dict(), args.path)
    dist.barrier()  # nobody reads before rank 0 has finished writing
    fresh = build_model("simple").to(device)
    fresh.load_state_dict(torch.load(args.path, map_location=device, weights_only=True))
    # the wrapper's own state_dict into an unwrapped model: strict=False lists the keys that do not match
    mismatch = build_model("simple").load_state_dict(ddp.state_dict(), strict=False)
    result(missing=mismatch.missing_keys[:2], unexpected=mismatch.unexpected_keys[:2],
           wrapper_keys=list(ddp.state_dict())[:2], module_keys=list(ddp.module.state_dict())[:2],
           loaded_equals_trained=max_abs_diff(list(fresh.parameters()), list(ddp.module.parameters())) == 0,
           wrote=rank == 0, file_seen=os.path.exists(args.path))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
