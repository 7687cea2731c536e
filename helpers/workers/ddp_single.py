"""Train on one process: the starting point that ddp_train.py turns into data-parallel training.

    python helpers/workers/ddp_single.py --epochs 2

Same model, data, optimizer and logging as ddp_train.py, with nothing distributed: compare the
two files to see exactly what DistributedDataParallel needs. train_seconds times the training
steps only (data, forward, backward, optimizer), not start-up and not the evaluation.
"""
import argparse
import itertools
import time

import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, report, result
from helpers.kit.tensors import parameter_checksum


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["simple", "cnn"], default="simple")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=64, help="samples per optimizer step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--steps", type=int, default=0, help="stop after this many steps in total (0: all epochs)")
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


@torch.no_grad()
def evaluate(model: nn.Module, device: torch.device) -> tuple[float, int]:
    """Test accuracy over the whole test set, and how many images were counted."""
    test_set, _ = load(train=False)
    correct = total = 0
    model.eval()
    with torch.no_grad():  # no graph to build: evaluation computes no gradients
        for images, labels in DataLoader(test_set, batch_size=256):
            predictions = model(images.to(device)).argmax(dim=1)
            correct, total = correct + (predictions == labels.to(device)).sum().item(), total + len(labels)
    model.train()
    return correct / total, total


def main() -> None:
    args = parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)
    train_set, source = load(train=True)
    loader = DataLoader(train_set, batch_size=args.global_batch, shuffle=True)

    model = build_model(args.model).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    print(f"one process, data: {source}, global batch {args.global_batch}")

    total_steps = min(args.steps or args.epochs * len(loader), args.epochs * len(loader))
    step, train_seconds, accuracy, test_images = 0, 0.0, float("nan"), 0
    for epoch in range(args.epochs):
        started, epoch_losses = time.perf_counter(), []
        for images, labels in itertools.islice(loader, total_steps - step):
            loss = nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            report(step=step, loss=loss.item(), epoch=epoch)
            epoch_losses.append(loss.item())
            step += 1
            progress(step, total=total_steps)
        train_seconds += time.perf_counter() - started
        accuracy, test_images = evaluate(model, device)
        mean_loss = sum(epoch_losses) / len(epoch_losses)  # one batch's loss is too noisy to read
        print(f"epoch {epoch}: mean training loss {mean_loss:.3f}, test accuracy {accuracy:.3f}")
        if step == total_steps:
            break

    result(checksum=parameter_checksum(model), steps=step, data=source, train_seconds=train_seconds,
           accuracy=accuracy, test_images=test_images)


if __name__ == "__main__":
    main()
