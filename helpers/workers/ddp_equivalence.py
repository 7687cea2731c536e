"""Do N ranks x batch b give the same gradients as one process with batch N*b? Do the ranks stay equal?

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_equivalence.py --per-rank-batch 16 --steps 5
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_equivalence.py --no-ddp   # each rank alone

Every rank reports its first step's gradient (after DDP averaged it), a checksum of its weights
after every step, and its final weights, so the notebook can compare them with one process that
trains on the same global batches (helpers.lessons.ddp.single_process_reference).
"""
import argparse
import itertools
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import report, result
from helpers.kit.tensors import flat, parameter_checksum


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-rank-batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ddp", action="store_true", help="train each rank alone, to see them drift apart")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if "RANK" in os.environ:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    else:
        dist.init_process_group("nccl" if use_cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world_size = dist.get_rank(), dist.get_world_size()

    # No shuffle: global batch j is samples [j*N*b, (j+1)*N*b), split over the ranks by the sampler.
    train_set, _ = load(train=True, limit=args.per_rank_batch * world_size * args.steps)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=False)
    loader = DataLoader(train_set, batch_size=args.per_rank_batch, sampler=sampler)

    torch.manual_seed(args.seed)  # the same start on every rank (DDP would broadcast rank 0's anyway)
    model = build_model("simple").to(device)
    wrapped = model if args.no_ddp else DDP(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=args.lr)
    for step, (images, labels) in enumerate(itertools.islice(loader, args.steps)):
        loss = nn.functional.cross_entropy(wrapped(images.to(device)), labels.to(device))
        optimizer.zero_grad()
        loss.backward()  # with DDP: gradients all-reduced and divided by world_size
        if step == 0:
            result(first_gradient=flat([p.grad for p in model.parameters()]))
        optimizer.step()
        report(step=step, loss=loss.item(), checksum=parameter_checksum(model))
    result(final_weights=flat(list(model.parameters())), checksum=parameter_checksum(model),
           world_size=world_size, samples_seen=len(sampler))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
