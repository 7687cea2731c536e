"""The ZeroRedundancyOptimizer recipe's memory ladder, as tensor bytes per phase, at a size that fits a CPU.

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_ladder.py --impl notebooks/my_zero1.py

PyTorch's recipe (recipes_source/zero_redundancy_optimizer.rst) trains 20 x Linear(2000, 2000) under DDP with Adam,
once with ZeroRedundancyOptimizer and once without, and prints peak GPU memory after four phases: model created,
DDP created, before optimizer.step(), after it. Here: the same recipe with --width (default 500, 1/16 of the
parameters), three ways: DDP + Adam, DDP + ZeroRedundancyOptimizer(Adam), and a Zero1 class from --impl (without
DDP: it reduce-scatters the gradients itself). Every rank adds up the bytes its tensors hold: parameters, DDP's
bucket buffers, gradients, Adam state, and the Zero1's shards; "model created" when the model is created, "before
step()" after backward, "after step()" after the step. "DDP created" is not read when DDP is created: the bucket
buffers are reachable only through a comm hook (which notes each and then runs torch's default all-reduce), so
that row is the parameters plus those buffers, added up after backward. Tensors only: a peak also counts
temporaries and the allocator's rounding, these sums do not.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.zero import storage_bytes


def load_zero1(impl: str):
    path = Path(__file__).with_name("zero_solution.py") if impl == "solution" else Path(impl)
    sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.Zero1


def ladder(mode: str, width: int, rank: int, device: torch.device, zero1=None) -> dict[str, int]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(20)]).to(device)
    params = list(model.parameters())
    held = {"model created": storage_bytes(params)}
    buckets = {}
    if mode != "ours":
        model = DDP(model)

        def note_bucket(state, bucket):  # the buffer DDP allocated for this bucket, then torch's default hook
            buckets[bucket.index()] = bucket.buffer()
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, note_bucket)
    if mode == "torch_zero":
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=0.01)
    elif mode == "ours":
        optimizer = zero1(params, torch.optim.Adam, lr=0.01)
    else:
        optimizer = torch.optim.Adam(params, lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    inputs, labels = torch.randn(20, width, generator=generator), torch.randn(20, width, generator=generator)
    nn.functional.mse_loss(model(inputs.to(device)), labels.to(device)).backward()
    shards = list(getattr(optimizer, "shards", {}).values())
    # not read at DDP's creation: the buffers the comm hook received (the reducer allocates buckets in its constructor)
    held["DDP created"] = storage_bytes(params + list(buckets.values()))
    held["before step()"] = storage_bytes(params + list(buckets.values()) + [p.grad for p in params] + shards)
    optimizer.step()
    local = getattr(optimizer, "optim", None) or getattr(optimizer, "optimizer", optimizer)
    state = [v for s in local.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")]
    held["after step()"] = storage_bytes(params + list(buckets.values()) + [p.grad for p in params] + shards
                                         + [s.grad for s in shards] + state)
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--impl", default="", help="a file with a Zero1 class (your my_zero1.py); empty: skip ours")
    args = parser.parse_args()
    rank, _, device = init_distributed()
    modes = ["ddp", "torch_zero"] + (["ours"] if args.impl else [])
    zero1 = load_zero1(args.impl) if args.impl else None
    out = {mode: ladder(mode, args.width, rank, device, zero1) for mode in modes}
    result(width=args.width, n_params=20 * (args.width + 1) * args.width, **out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
