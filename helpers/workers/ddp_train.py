"""Train with DistributedDataParallel: the source article's tutorial, fixed and launchable.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_train.py --epochs 2
    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_train.py --model cnn
    python helpers/workers/ddp_train.py --epochs 1        # one process works too

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and a free MASTER_PORT, so nothing is
hard-coded. The backend follows the hardware: nccl with one GPU per rank, gloo on CPU.
--global-batch is what one optimizer step sees, all ranks together: each rank takes
global_batch / world_size, so any number of ranks that divides --global-batch trains the same thing
with the same --lr (any other number stops with an error).
train_seconds times the training steps only, not start-up and not the evaluation. Only rank 0 prints.
"""
import argparse
import itertools
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, report, result
from helpers.kit.tensors import parameter_checksum


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["simple", "cnn"], default="simple")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step, all ranks")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps in total (0: all epochs)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def init_distributed() -> tuple[int, int, torch.device]:
    """Join the process group; return (rank, world_size, device)."""
    use_cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if use_cuda else "gloo"
    if "RANK" in os.environ:  # started by torchrun: the environment says who we are
        dist.init_process_group(backend)
    else:  # plain `python`: a group of one, no network needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size(), device


@torch.no_grad()
def evaluate(model: nn.Module, device: torch.device, rank: int, world_size: int) -> tuple[float, int, list[int]]:
    """Test accuracy over the whole test set, how many images were counted (all ranks together), and the
    indices this rank counted: each rank counts its share, all_reduce sums the counts."""
    test_set, _ = load(train=False)
    my_share = Subset(test_set, range(rank, len(test_set), world_size))  # no padding: each image once
    counts = torch.zeros(2, device=device)  # correct, total
    counted: list[int] = []  # the test-set indices this rank counted, in order
    model.eval()
    with torch.no_grad():  # no graph to build: evaluation computes no gradients
        for images, labels in DataLoader(my_share, batch_size=256):
            predictions = model(images.to(device)).argmax(dim=1)
            counts += torch.tensor([(predictions == labels.to(device)).sum().item(), len(labels)], device=device)
            counted += my_share.indices[len(counted):len(counted) + len(labels)]
    dist.all_reduce(counts)
    model.train()
    return (counts[0] / counts[1]).item(), int(counts[1].item()), counted


def main() -> None:
    args = parse_args()
    rank, world_size, device = init_distributed()
    if args.global_batch % world_size:
        raise SystemExit(f"--global-batch {args.global_batch} does not split evenly over {world_size} ranks")
    per_rank_batch = args.global_batch // world_size
    torch.manual_seed(args.seed)
    train_set, source = load(train=True)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler)

    model = DDP(build_model(args.model).to(device))  # DDP broadcasts rank 0's weights to every rank
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if rank == 0:
        print(f"{world_size} rank(s), backend {dist.get_backend()}, data: {source}, "
              f"global batch {args.global_batch} = {world_size} x {per_rank_batch}")

    total_steps = min(args.steps or args.epochs * len(loader), args.epochs * len(loader))
    step, train_seconds, accuracy, test_images, counted = 0, 0.0, float("nan"), 0, []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # a new shuffle every epoch, the same one on every rank
        started, epoch_losses = time.perf_counter(), []
        for images, labels in itertools.islice(loader, total_steps - step):
            loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients over all ranks here
            optimizer.step()
            report(step=step, loss=loss.item(), epoch=epoch)
            epoch_losses.append(loss.item())
            step += 1
            progress(step, total=total_steps)
        train_seconds += time.perf_counter() - started
        accuracy, test_images, counted = evaluate(model, device, rank, world_size)
        if rank == 0:
            mean_loss = sum(epoch_losses) / len(epoch_losses)  # one batch's loss is too noisy to read
            print(f"epoch {epoch}: mean training loss {mean_loss:.3f} (rank 0's batches), "
                  f"test accuracy {accuracy:.3f}")
        if step == total_steps:
            break

    result(checksum=parameter_checksum(model), steps=step, world_size=world_size, data=source,
           train_seconds=train_seconds, accuracy=accuracy, test_images=test_images, test_indices=counted)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
