"""Train one model in fp32, bf16 or fp16 (+ GradScaler) and report time per step, accuracy, memory.

    torchrun --standalone --nproc-per-node 1 helpers/workers/amp_train.py --precision bf16
    torchrun --standalone --nproc-per-node 1 helpers/workers/amp_train.py --precision fp16 --steps 200
    python helpers/workers/amp_train.py --precision all --per-rank-batch 1024 --steps 60    # on a GPU

Runs on the GPU when there is one, else on the CPU (one thread). Only the forward pass changes between
precisions (torch.autocast); the weights, gradients and optimizer state stay fp32 throughout.
fp16 needs a GradScaler (its range is narrow); bf16 has fp32's range and does not.
`--precision all` trains fp32, fp16 and bf16 one after another (on a GPU: bf16 only where the GPU has it
natively, Ampere or newer; torch.cuda.is_bf16_supported() alone also says True where it is only emulated)
and prints each one's speed relative to fp32. On a GPU "fp32" is torch's default, in which cuDNN runs fp32
convolutions as TF32 on Ampere and newer (torch.backends.cudnn.conv.fp32_precision is "tf32"; matmuls stay
fp32: torch.backends.cuda.matmul.fp32_precision is "none"); --no-tf32 sets both to "ieee" for a plain-fp32
baseline. (The allow_tf32 flags are the legacy form of the same settings.)
"""
import argparse
import statistics
import time

import torch
from torch.nn import functional as F

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, report, result

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def evaluate(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> float:
    images, labels = load(train=False)[0].tensors
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        predictions = model(images.to(device)).argmax(dim=1)
    return (predictions.cpu() == labels).float().mean().item()


def train(precision: str, model_name: str, steps: int, per_rank_batch: int, device: torch.device) -> dict:
    """Train from the same seed; return the median time per step (after warm-up) and test accuracy."""
    dtype = DTYPES[precision]
    torch.manual_seed(0)
    images, labels = load(train=True)[0].tensors
    model = build_model(model_name).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    # The precision lives in two lines: autocast's `enabled=` below, and the scaler's `enabled=` here
    # (a disabled scaler passes every call through, so one loop serves all three precisions).
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    step_times = []
    for step in range(steps):
        index = torch.randint(len(images), (per_rank_batch,))
        x, y = images[index].to(device), labels[index].to(device)
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        if device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before reading the clock
        step_times.append(time.perf_counter() - start)
        report(step=step, loss=loss.item())
        progress(step + 1, total=steps)

    return dict(precision=precision, device=device.type, ms_per_step=1000 * statistics.median(step_times[3:]),
                accuracy=evaluate(model, device, dtype), final_loss=loss.item(),
                peak_memory_mb=torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None)


def compare(model_name: str, steps: int, per_rank_batch: int, device: torch.device) -> dict:
    """Every precision this device runs natively, from the same seed, after a warm-up run."""
    precisions = ["fp32", "fp16"]
    if device.type == "cpu" or torch.cuda.is_bf16_supported(including_emulation=False):
        precisions.append("bf16")
    train("fp32", model_name, 5, per_rank_batch, device)  # warm-up: allocator, CUDA context, cuDNN autotuning
    outcomes = {p: train(p, model_name, steps, per_rank_batch, device) for p in precisions}
    if device.type == "cuda":
        print(f"fp32 here means: cuDNN convolutions fp32_precision={torch.backends.cudnn.conv.fp32_precision!r}, "
              f"matmuls fp32_precision={torch.backends.cuda.matmul.fp32_precision!r}")
    for p, o in outcomes.items():
        speedup = outcomes["fp32"]["ms_per_step"] / o["ms_per_step"]
        memory = f", peak memory {o['peak_memory_mb']:.0f} MiB" if o["peak_memory_mb"] is not None else ""
        print(f"{p} on {device.type}: {o['ms_per_step']:.2f} ms/step ({speedup:.2f}x fp32's speed){memory}, "
              f"test accuracy {o['accuracy']:.3f}")
    return outcomes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", choices=[*DTYPES, "all"], default="fp32")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps in total")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--no-tf32", action="store_true", help="GPU: fp32 convolutions and matmuls without TF32")
    args = parser.parse_args()
    if args.no_tf32:
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core per run: timings then compare on a shared 2-core machine
    if args.precision == "all":
        result(outcomes=compare(args.model, args.steps, args.per_rank_batch, device))
        return
    outcome = train(args.precision, args.model, args.steps, args.per_rank_batch, device)
    print(f"{args.precision} on {device.type}: {outcome['ms_per_step']:.1f} ms/step, "
          f"test accuracy {outcome['accuracy']:.3f}")
    result(**outcome)


if __name__ == "__main__":
    main()
