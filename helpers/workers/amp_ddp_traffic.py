"""What DDP sends per step with AMP: autocast leaves the gradients fp32; bf16_compress_hook halves them.

    torchrun --standalone --nproc-per-node 2 helpers/workers/amp_ddp_traffic.py --steps 5

Trains the same model three ways, each for --steps steps from the same start: fp32; bf16 autocast;
bf16 autocast with DDP's bf16_compress_hook (torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py).
A wrapper around each communication hook records the dtype and bytes of every tensor the hook hands to
dist.all_reduce. The first two modes use allreduce_hook, which does what DDP does without a hook.
gloo on CPUs, nccl on GPUs (there bf16_compress_hook's docstring asks for NCCL later than 2.9.6).
Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook, bf16_compress_hook
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.data import load
from helpers.kit.distributed import init_distributed
from helpers.kit.models import build_model
from helpers.kit.reporting import result
from helpers.kit.tensors import max_abs_diff

MODES = {"fp32": (False, allreduce_hook), "bf16 autocast": (True, allreduce_hook),
         "bf16 autocast + bf16_compress_hook": (True, bf16_compress_hook)}


def counted(hook, sent: list[tuple[str, int]]):
    """Wrap a DDP comm hook: record (dtype, bytes) of every tensor it hands to dist.all_reduce."""
    def wrapper(state, bucket):
        real_all_reduce = dist.all_reduce

        def all_reduce(tensor, *args, **kwargs):
            sent.append((str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size()))
            return real_all_reduce(tensor, *args, **kwargs)

        dist.all_reduce = all_reduce  # the hooks call dist.all_reduce, so they now call the counter
        try:
            return hook(state, bucket)
        finally:
            dist.all_reduce = real_all_reduce
    return wrapper


def train(autocast: bool, hook, args: argparse.Namespace, rank: int, device: torch.device) -> dict:
    torch.manual_seed(0)
    model = DDP(build_model(args.model).to(device))
    sent: list[tuple[str, int]] = []
    model.register_comm_hook(state=None, hook=counted(hook, sent))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    images, labels = load(train=True)[0].tensors
    generator = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        index = torch.randint(len(images), (args.per_rank_batch,), generator=generator)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            loss = F.cross_entropy(model(images[index].to(device)), labels[index].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP's hook runs here, once per bucket
        optimizer.step()
    parameter = next(model.parameters())
    return dict(bytes_per_step=sum(size for _, size in sent) / args.steps,
                dtypes_sent=sorted({dtype for dtype, _ in sent}),
                weight_dtype=str(parameter.dtype).removeprefix("torch."),
                grad_dtype=str(parameter.grad.dtype).removeprefix("torch."),
                parameters=sum(p.numel() for p in model.parameters()),
                weights=[p.detach().cpu() for p in model.parameters()])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps in total, per mode")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--model", default="simple")
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    if device.type == "cpu":
        torch.set_num_threads(1)  # two ranks share two cores

    outcomes = {mode: train(autocast, hook, args, rank, device) for mode, (autocast, hook) in MODES.items()}
    weights = {mode: outcome.pop("weights") for mode, outcome in outcomes.items()}
    for mode, outcome in outcomes.items():
        outcome["max_weight_diff_vs_fp32"] = max_abs_diff(weights[mode], weights["fp32"])
        # Against autocast alone, only the hook's bf16 rounding of the gradients can make a difference.
        outcome["max_weight_diff_vs_bf16_autocast"] = max_abs_diff(weights[mode], weights["bf16 autocast"])
        if rank == 0:
            print(f"{mode}: {outcome['bytes_per_step']:.0f} bytes all-reduced per step ({outcome['dtypes_sent']}), "
                  f"weights {outcome['weight_dtype']}, gradients {outcome['grad_dtype']}")
    result(world_size=world_size, modes=outcomes)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
