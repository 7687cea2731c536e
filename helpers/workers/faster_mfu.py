"""What share of this machine's measured matmul rate a training step reaches: FLOPs counted by torch, rates, times.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_mfu.py

The model of faster_compile.py (helpers.kit.faster_step.build_model(512, 3)), --per-rank-batch digits per rank.
1. torch.utils.flop_counter.FlopCounterMode around one forward and backward: the FLOPs torch counts, per operation.
2. This machine's matmul rate, as each rank sees it while the other rank computes too: n x n float32 matrices
   multiplied, several sizes taking turns under the timing protocol (helpers.kit.timing), 2 n^3 FLOPs each; a turn
   is (1024 / n)^3 products, the same FLOPs for every size. A
   measured rate, not the hardware's published peak (which model FLOPs utilisation, MFU, divides by).
3. A DDP training step (forward, backward with DDP's all-reduces, SGD step) and the same step under no_sync()
   (no all-reduce: the control), taking turns under the timing protocol.
Each rank hands back its counts and timings; helpers/lessons/faster_step.py computes the fraction. On GPUs the
model, batch and matrices go to this rank's GPU and every timed call waits for its kernels. Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.flop_counter import FlopCounterMode

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import build_model, digits_batches, release, synchronize
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns

WIDTH, DEPTH, SIZES = 512, 3, (256, 512, 1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--per-rank-batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    (images, labels), = digits_batches(rank, args.per_rank_batch, 1, device)
    model = DDP(build_model(WIDTH, DEPTH).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        synchronize(device)

    def local_step() -> None:
        with model.no_sync():
            train_step()

    counter = FlopCounterMode(display=False)
    with counter:
        torch.nn.functional.cross_entropy(model.module(images), labels).backward()
    per_operation = {str(op): flops for op, flops in counter.get_flop_counts()["Global"].items()}
    model.zero_grad(set_to_none=True)
    progress(1, 3)

    matrices = {n: (torch.rand(n, n, device=device), torch.rand(n, n, device=device)) for n in SIZES}

    calls = {n: (max(SIZES) // n) ** 3 for n in SIZES}  # the same FLOPs in every size's turn

    def matmuls(a: torch.Tensor, b: torch.Tensor, count: int) -> None:
        for _ in range(count):
            torch.mm(a, b)
        synchronize(device)

    rates = take_turns({f"{n}": (lambda a=a, b=b, k=calls[n]: matmuls(a, b, k)) for n, (a, b) in matrices.items()},
                       rounds=args.rounds, warmup=1, between=dist.barrier)
    progress(2, 3)
    steps = take_turns({"DDP step": train_step, "no all-reduce (no_sync)": local_step},
                       rounds=args.rounds + 2, warmup=2, repeat=3, between=dist.barrier)
    progress(3, 3)
    result(flops=counter.get_total_flops(), per_operation=per_operation, per_rank_batch=args.per_rank_batch,
           layers=[[m.in_features, m.out_features] for m in model.module.modules() if isinstance(m, torch.nn.Linear)],
           matmul={name: t.as_dict() for name, t in rates.items()}, matmul_calls=calls,
           steps={name: t.as_dict() for name, t in steps.items()}, threads=torch.get_num_threads(),
           world_size=world_size)
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
