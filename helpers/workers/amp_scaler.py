"""Watch a GradScaler at work: the loss scale every step, growth, and a skipped step with backoff.

    torchrun --standalone --nproc-per-node 1 helpers/workers/amp_scaler.py --spike-step 19
    torchrun --standalone --nproc-per-node 1 helpers/workers/amp_scaler.py --max-norm 0.3 --steps 30

fp16 autocast on the GPU when there is one, else on the CPU. At --spike-step the loss is multiplied
by --spike (a stand-in for one bad batch): the scaled gradients overflow fp16, the scaler sees
inf/NaN, skips optimizer.step() and halves the scale. Every --growth-interval clean steps in a
row, it doubles the scale again. Gradients are unscaled before clipping, so --max-norm means what it
says: each step reports the norm of the scaled gradients (before unscale_), and the true gradient norm
before and after clip_grad_norm_.
"""
import argparse

import torch
from torch.nn import functional as F

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, report, result


def scaled_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                x: torch.Tensor, y: torch.Tensor, spike: float, max_norm: float) -> dict:
    """One fp16 AMP step with clipping; what it did, read from the scaler and from the weights themselves."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = F.cross_entropy(model(x), y) * spike  # spike > 1: a stand-in for one bad batch
    optimizer.zero_grad(set_to_none=True)
    scale = scaler.get_scale()
    scaler.scale(loss).backward()
    scaled_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()  # S times too big
    scaler.unscale_(optimizer)  # true gradients now, so clipping and the norm below are meaningful
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item()  # the norm before clipping
    clipped_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    weights_before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)  # skips optimizer.step() if any gradient is inf/NaN
    stepped = any(not torch.equal(before, p) for before, p in zip(weights_before, model.parameters(), strict=True))
    scaler.update()  # halves the scale after a skip; doubles it after growth_interval clean steps
    return dict(scale=scale, loss=loss.item(), scaled_norm=scaled_norm, grad_norm=grad_norm,
                clipped_norm=clipped_norm, skipped=not stepped, backed_off=scaler.get_scale() < scale)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--init-scale", type=float, default=2.0**10)
    parser.add_argument("--growth-interval", type=int, default=8)
    parser.add_argument("--spike-step", type=int, default=19)
    parser.add_argument("--spike", type=float, default=1e6)
    parser.add_argument("--max-norm", type=float, default=0.3, help="clip the gradient norm to this")
    parser.add_argument("--per-rank-batch", type=int, default=64)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    torch.manual_seed(0)
    images, labels = load(train=True)[0].tensors
    model = build_model("simple").to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler(device.type, init_scale=args.init_scale,
                                  growth_interval=args.growth_interval)

    skipped = []
    for step in range(args.steps):
        index = torch.randint(len(images), (args.per_rank_batch,))
        x, y = images[index].to(device), labels[index].to(device)
        row = scaled_step(model, optimizer, scaler, x, y, args.spike if step == args.spike_step else 1.0,
                          args.max_norm)
        if row["skipped"]:
            skipped.append(step)
        report(step=step, **row)
        progress(step + 1, total=args.steps)

    print(f"steps that left the weights unchanged: {skipped}, final scale {scaler.get_scale():g}")
    result(skipped=skipped, final_scale=scaler.get_scale())


if __name__ == "__main__":
    main()
