"""Exercise start: a one-process training script. Make it a DDP worker (lesson 02's exercise).

    python helpers/workers/ddp_exercise_single.py

Keep the `result(...)` call: the notebook's check_ddp_worker() reads it (the weights, and each .grad after the last
step). The data order is fixed (no shuffle) so that a correct DDP version ends with the same weights as this script.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import result
from helpers.kit.tensors import flat

GLOBAL_BATCH = 32


def main() -> None:
    train_set, _ = load(train=True, limit=256)
    loader = DataLoader(train_set, batch_size=GLOBAL_BATCH, shuffle=False)

    torch.manual_seed(0)
    model = build_model("simple")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    samples_seen = 0
    for images, labels in loader:
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        samples_seen += len(labels)
    print(f"trained on {samples_seen} samples, last loss {loss.item():.3f}")
    # the weights, and each parameter's .grad after the last step: the check compares both across the ranks
    result(weights=flat(list(model.parameters())), gradients=[p.grad for p in model.parameters()],
           samples_seen=samples_seen)


if __name__ == "__main__":
    main()
