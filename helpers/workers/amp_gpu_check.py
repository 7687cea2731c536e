"""Lesson 04's GPU measurement: fp32, fp16 (+ GradScaler) and bf16 autocast on one GPU, and their step-time ratios.

    python helpers/workers/amp_gpu_check.py                       # SmallCNN, 1024 per step, 60 steps
    python helpers/workers/amp_gpu_check.py --per-rank-batch 4096 --steps 100

Runs amp_train.py's train() for each precision on cuda:0 and prints one line per precision plus the
ratios to fp32 (above 1: faster than fp32). bf16 runs only where the GPU supports it natively (Ampere
or newer): torch.cuda.is_bf16_supported() alone also says True for older GPUs that only emulate it.
On a machine without a GPU it says so and exits with code 0: there is nothing to measure.
"""
import argparse
import json

import torch

from helpers.workers.amp_train import train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps in total, per precision")
    parser.add_argument("--per-rank-batch", type=int, default=1024)
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the GPU comparison did not run")
        return

    device = torch.device("cuda:0")
    precisions = ["fp32", "fp16"] + (["bf16"] if torch.cuda.is_bf16_supported(including_emulation=False) else [])
    train("fp32", args.model, 5, args.per_rank_batch, device)  # warm-up: CUDA context, cuDNN autotuning
    outcomes = {p: train(p, args.model, args.steps, args.per_rank_batch, device) for p in precisions}
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.model}, "
          f"batch {args.per_rank_batch}, {args.steps} steps")
    for p, o in outcomes.items():
        speedup = outcomes["fp32"]["ms_per_step"] / o["ms_per_step"]
        print(f"{p}: {o['ms_per_step']:.2f} ms/step ({speedup:.2f}x fp32's speed), "
              f"peak memory {o['peak_memory_mb']:.0f} MiB, test accuracy {o['accuracy']:.3f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"device": torch.cuda.get_device_name(device), "outcomes": outcomes}, file, indent=1)


if __name__ == "__main__":
    main()
