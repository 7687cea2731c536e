"""Uneven inputs: one rank runs out of batches first. Without Join the others are stuck; with it, all finish.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_uneven.py            # rank 0 fails
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_uneven.py --join     # both finish

Rank r gets 5 - 2r batches (rank 0: 5, rank 1: 3). Every backward ends in an all-reduce that needs
every rank, so after rank 1 has left, rank 0's fourth backward waits for a partner that never comes
(here gloo notices the closed connection; a rank that stays alive, or NCCL, can leave it hanging until
the collective timeout, set to 20 s here).
`with model.join():` (DistributedDataParallel.join, torch/distributed/algorithms/join.py) lets a rank
that has run out shadow the others' all-reduces with zeros, and at the end broadcasts the final
model from the last rank to join, so every rank ends with the same weights.
"""
import argparse
import datetime

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.models import build_model
from helpers.kit.reporting import result
from helpers.kit.tensors import parameter_checksum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--join", action="store_true", help="wrap the training loop in model.join()")
    args = parser.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))  # CPU tensors only: gloo
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(build_model("simple"))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [(torch.randn(8, 1, 28, 28), torch.randint(0, 10, (8,))) for _ in range(5 - 2 * rank)]

    def train() -> int:
        for done, (images, labels) in enumerate(batches):
            optimizer.zero_grad()
            try:
                nn.functional.cross_entropy(model(images), labels).backward()  # all-reduce: needs every rank
            except RuntimeError as error:  # reported, not re-raised, so that the notebook can show it
                reason = str(error).split("] ", 1)[-1].split(" [")[0]  # without gloo's source path and port
                print(f"rank {rank}: backward of batch {done + 1} failed: {reason}")
                result(steps=done, error=reason)
                return done
            optimizer.step()
        return len(batches)

    if args.join:
        with model.join():
            steps = train()
    else:
        steps = train()
    if steps == len(batches):
        print(f"rank {rank} finished its {steps} batches")
        result(steps=steps, checksum=parameter_checksum(model))
        dist.destroy_process_group()

if __name__ == "__main__":
    main()
