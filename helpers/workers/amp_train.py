"""Train one model in fp32, bf16 and fp16 (+ GradScaler), the precisions taking turns, and time them fairly.

    torchrun --standalone --nproc-per-node 1 helpers/workers/amp_train.py --precision all
    torchrun --standalone --nproc-per-node 1 helpers/workers/amp_train.py --precision fp32,bf16 --rounds 7
    python helpers/workers/amp_train.py --precision all --per-rank-batch 1024 --steps-per-turn 20   # on a GPU

Runs on the GPU when there is one, else on the CPU (one thread). Only the forward pass changes between
precisions (torch.autocast); the weights, gradients and optimizer state stay fp32 throughout.
fp16 needs a GradScaler (its range is narrow); bf16 has fp32's range and does not.

Each precision trains its own copy of the model from the same seed. The precisions take turns, in a shuffled
order each round, --steps-per-turn steps per turn, after one warm-up round (helpers/kit/timing.py), so that a busy
machine slows them all alike; every precision ends with the same number of steps and is then tested. The verdict
against fp32 is computed from the rounds' spreads: "faster" only when they do not overlap. On a GPU, "all" skips
bf16 where the GPU has no native bf16 (before Ampere; torch.cuda.is_bf16_supported() alone also says True where it
is only emulated), and "fp32" is torch's default, in which cuDNN runs fp32 convolutions as TF32 on Ampere and newer
(torch.backends.cudnn.conv.fp32_precision is "tf32"; matmuls stay fp32: torch.backends.cuda.matmul.fp32_precision
is "none"); --no-tf32 sets both to "ieee" for a plain-fp32 baseline.
"""
import argparse

import torch
from torch.nn import functional as F

from helpers.kit.data import load
from helpers.kit.models import build_model
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns, verdict

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class Training:
    """One precision's model, optimizer, scaler and batches, trained a few steps per turn."""

    def __init__(self, precision: str, model_name: str, per_rank_batch: int, device: torch.device) -> None:
        self.dtype, self.device, self.per_rank_batch = DTYPES[precision], device, per_rank_batch
        torch.manual_seed(0)
        self.model = build_model(model_name).to(device)
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=2e-3)
        # The precision lives in two lines: autocast's `enabled=` below, and the scaler's `enabled=` here
        # (a disabled scaler passes every call through, so one loop serves all three precisions).
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.dtype == torch.float16)
        self.images, self.labels = load(train=True)[0].tensors
        self.batches = torch.Generator().manual_seed(0)  # the same batches for every precision
        self.steps_done = 0

    def steps(self, count: int) -> None:
        for _ in range(count):
            index = torch.randint(len(self.images), (self.per_rank_batch,), generator=self.batches)
            x, y = self.images[index].to(self.device), self.labels[index].to(self.device)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                loss = F.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad(set_to_none=True)
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            self.steps_done += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # GPU work is asynchronous: wait for it before the clock is read

    @torch.no_grad()
    def accuracy(self) -> float:
        images, labels = load(train=False)[0].tensors
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            predictions = self.model(images.to(self.device)).argmax(dim=1)  # inference under autocast too
        return (predictions.cpu() == labels).float().mean().item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--precision", default="all", help="all, or a comma-separated list of fp32, bf16, fp16")
    parser.add_argument("--model", default="cnn")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (at least 5)")
    parser.add_argument("--steps-per-turn", type=int, default=8)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--no-tf32", action="store_true", help="GPU: fp32 convolutions and matmuls without TF32")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.precision == "all":
        precisions = ["fp32", "fp16"]
        if device.type == "cpu" or torch.cuda.is_bf16_supported(including_emulation=False):
            precisions.insert(1, "bf16")
    else:
        precisions = args.precision.split(",")
    unknown = [p for p in precisions if p not in DTYPES]
    if unknown or args.rounds < 5:
        parser.error(f"unknown precision {unknown} (choose from {list(DTYPES)})" if unknown
                     else f"--rounds must be at least 5, got {args.rounds}")
    if args.no_tf32:
        torch.backends.cudnn.conv.fp32_precision = "ieee"
        torch.backends.cuda.matmul.fp32_precision = "ieee"
    if device.type == "cpu":
        torch.set_num_threads(1)  # one core: the precisions compare on a shared 2-core machine

    trainings = {p: Training(p, args.model, args.per_rank_batch, device) for p in precisions}
    total = len(precisions) * (args.rounds + 1) * args.steps_per_turn

    peak_extra_mb = {p: 0.0 for p in precisions}  # GPU memory a turn needs above what all three hold at rest

    def turn(precision: str) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            at_rest = torch.cuda.memory_allocated()
        trainings[precision].steps(args.steps_per_turn)
        if device.type == "cuda":
            extra = (torch.cuda.max_memory_allocated() - at_rest) / 2**20
            peak_extra_mb[precision] = max(peak_extra_mb[precision], extra)
        progress(sum(t.steps_done for t in trainings.values()), total=total)

    timings = take_turns({p: (lambda p=p: turn(p)) for p in precisions}, rounds=args.rounds, warmup=1)
    outcomes = {}
    for p, timing in timings.items():
        per_step = timing.median() / args.steps_per_turn
        outcomes[p] = dict(ms_per_step=1000 * per_step, accuracy=trainings[p].accuracy(),
                           steps=trainings[p].steps_done, device=device.type,
                           peak_extra_mb=peak_extra_mb[p] if device.type == "cuda" else None)
        memory = f", {peak_extra_mb[p]:.0f} MiB of GPU memory above rest" if device.type == "cuda" else ""
        print(f"{p} on {device.type}: {1000 * per_step:.2f} ms/step (median of {args.rounds} rounds){memory}, "
              f"test accuracy {outcomes[p]['accuracy']:.3f} after {trainings[p].steps_done} steps")
    if device.type == "cuda":
        print(f"fp32 here means: cuDNN convolutions fp32_precision={torch.backends.cudnn.conv.fp32_precision!r}, "
              f"matmuls fp32_precision={torch.backends.cuda.matmul.fp32_precision!r}")
    for p in precisions[1:] if precisions[0] == "fp32" else []:
        print(verdict(timings[p], timings["fp32"]).sentence)
    result(outcomes=outcomes, steps_per_turn=args.steps_per_turn,
           timings={p: timing.as_dict() for p, timing in timings.items()})


if __name__ == "__main__":
    main()
