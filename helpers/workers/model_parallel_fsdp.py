"""FSDP2: each rank keeps a shard of every layer; layers are all-gathered to run, gradients reduce-scattered.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_fsdp.py --steps 3

The model is built as one too large for a device must be: on the meta device (shapes, no storage), sharded there,
then `to_empty` allocates this rank's shards only, and each layer is filled from one full layer at a time (the
values mlp() draws). Beside it, a shortcut that goes wrong on CPU: reset_parameters() on every rank.
`fully_shard` goes on every Linear, then on the whole model. Each rank records its shard shapes, counts the
all-gathers and reduce-scatters of each step (by wrapping the two functions FSDP calls), and trains a DDP copy on
the same data with plain SGD (Adam would hide a gradient twice too large; SGD moves the weights twice as far):
gradients compared before each step (full_tensor() against DDP's .grad), parameters after the last. Then one step
each of copies sharded with MixedPrecisionPolicy(param_dtype=torch.bfloat16), with reshard_after_forward=False, and
with the default reshard_after_forward=None on a root that owns the output layer (None: True for inner modules,
False for the root, fully_shard's docstring). Works with one process.
"""
import argparse
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import distribute_tensor
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.models import mlp
from helpers.kit.reporting import report, result
from helpers.kit.tensors import max_abs_diff

traffic: Counter = Counter()
reduce_ops: set[str] = set()  # the ReduceOp FSDP passes to reduce_scatter_single


def count_calls(name: str, full_size_arg: str) -> None:
    """Replace dist.<name> by a wrapper that counts calls and the bytes of the full (unsharded) tensor."""
    original = getattr(dist, name)

    def counted(*args, **kwargs):
        full = kwargs[full_size_arg] if full_size_arg in kwargs else args[0 if full_size_arg == "output" else 1]
        traffic[f"{name} calls"] += 1
        traffic[f"{name} bytes"] += full.numel() * full.element_size()
        if "op" in kwargs:
            reduce_ops.add(str(kwargs["op"]))
        return original(*args, **kwargs)

    setattr(dist, name, counted)


def shard(model: nn.Sequential, policy: MixedPrecisionPolicy, reshard_after_forward: bool | None = True,
          skip_last: bool = False) -> nn.Sequential:
    """fully_shard every Linear (all but the last one with skip_last: the root then owns it), then the model."""
    linears = [layer for layer in model if isinstance(layer, nn.Linear)]
    for layer in linears[:-1] if skip_last else linears:
        fully_shard(layer, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def build_on_meta(width: int, hidden_layers: int, device: torch.device) -> nn.Sequential:
    """A sharded mlp() that no rank ever holds whole: built on meta, sharded, then only the shards allocated."""
    with torch.device("meta"):
        model = mlp(width, hidden_layers)  # shapes only: no memory for any weight
    shard(model, MixedPrecisionPolicy())   # each parameter becomes a DTensor holding this rank's shard, still meta
    model.to_empty(device=device)          # allocates this rank's shards, uninitialised
    return model


def fill_like_mlp(model: nn.Sequential, seed: int = 0) -> None:
    """Fill each shard with the values mlp(seed=seed) would hold, drawing one full layer at a time."""
    torch.manual_seed(seed)
    for layer in model:  # (under no_grad: the shards are trainable parameters)
        if isinstance(layer, nn.Linear):
            full = nn.Linear(layer.in_features, layer.out_features)  # one layer, drawn in mlp()'s order
            for name, sharded in layer.named_parameters():
                mine = distribute_tensor(getattr(full, name).detach(), sharded.device_mesh, sharded.placements,
                                         src_data_rank=None)  # this rank's slice, no communication
                with torch.no_grad():
                    sharded.to_local().copy_(mine.to_local())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--hidden-layers", type=int, default=1)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    # FSDP2 calls these two at run time (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py).
    count_calls("all_gather_single", "output")
    count_calls("reduce_scatter_single", "input")
    rank, world_size, device = init_distributed()

    model = build_on_meta(args.width, args.hidden_layers, device)
    meta = {"local_bytes": sum(p.to_local().numel() * p.element_size() for p in model.parameters())}
    fill_like_mlp(model)
    eager = shard(mlp(args.width, args.hidden_layers).to(device), MixedPrecisionPolicy())  # built whole, then sharded
    meta["diff_to_eager"] = max_abs_diff([p.to_local() for p in model.parameters()],
                                         [p.to_local() for p in eager.parameters()])
    # The shortcut: every rank runs reset_parameters() on its own shard, from the same seed.
    shortcut = build_on_meta(args.width, args.hidden_layers, device)
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        for layer in shortcut:
            if isinstance(layer, nn.Linear):
                layer.reset_parameters()
    meta["shortcut_warnings"] = sorted({str(warning.message) for warning in warned})
    weight = shortcut[1].weight.full_tensor()  # the first layer's weight, gathered
    half = weight.shape[0] // 2
    meta["shortcut_halves_equal"] = bool(torch.equal(weight[:half], weight[half:2 * half]))
    ddp_model = DDP(mlp(args.width, args.hidden_layers).to(device))  # same seed: same starting weights
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ddp_optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.1)
    shards = {name: {"full": list(p.shape), "local": list(p.to_local().shape)}
              for name, p in model.named_parameters()}

    per_rank_batch = args.global_batch // world_size
    generator = torch.Generator().manual_seed(rank)  # each rank its own data, as in DDP
    per_step, grad_diffs, grad_sizes = [], [], []
    for step in range(args.steps):
        images = torch.rand(per_rank_batch, 1, 28, 28, generator=generator).to(device)
        labels = torch.randint(0, 10, (per_rank_batch,), generator=generator).to(device)
        traffic.clear()
        loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        per_step.append(dict(traffic))
        ddp_loss = nn.functional.cross_entropy(ddp_model(images), labels)
        ddp_loss.backward()
        # Before the step: FSDP's reduce-scattered gradient shards, gathered (full_tensor() is a collective,
        # outside the counted traffic), against DDP's all-reduced gradients.
        ddp_grads = [p.grad for p in ddp_model.parameters()]
        grad_diffs.append(max_abs_diff([p.grad.full_tensor() for p in model.parameters()], ddp_grads))
        grad_sizes.append(max(g.abs().max().item() for g in ddp_grads))
        optimizer.step()
        optimizer.zero_grad()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
        report(step=step, loss=loss.item(), ddp_loss=ddp_loss.item())

    # full_tensor() all-gathers a sharded parameter: the check itself is one more collective per tensor.
    max_diff = max_abs_diff([p.full_tensor() for p in model.parameters()], list(ddp_model.parameters()))

    # The same model gathered and reduced in bf16; the optimizer would still update fp32 shards.
    bf16_model = shard(mlp(args.width, args.hidden_layers).to(device), MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    fp32_model = shard(mlp(args.width, args.hidden_layers).to(device), MixedPrecisionPolicy())
    # And kept gathered from forward to backward: one all-gather per layer and step instead of two.
    kept_model = shard(mlp(args.width, args.hidden_layers).to(device), MixedPrecisionPolicy(),
                       reshard_after_forward=False)
    # The default (None), with the output layer left to the root's group.
    default_model = shard(mlp(args.width, args.hidden_layers).to(device), MixedPrecisionPolicy(),
                          reshard_after_forward=None, skip_last=True)
    root_params = sum(p.numel() for p in default_model[-1].parameters())
    losses, extra = {}, {}
    for name, copy in (("bf16", bf16_model), ("fp32", fp32_model), ("no_reshard", kept_model),
                       ("default", default_model)):
        traffic.clear()
        losses[name] = nn.functional.cross_entropy(copy(images), labels)
        losses[name].backward()
        extra[name] = dict(traffic)
    result(shards=shards, traffic=per_step, bf16_traffic=extra["bf16"], no_reshard_traffic=extra["no_reshard"],
           default_traffic=extra["default"], root_params=root_params, reduce_ops=sorted(reduce_ops),
           max_param_diff=max_diff, grad_diffs=grad_diffs, grad_sizes=grad_sizes,
           n_params=sum(q.numel() for q in ddp_model.parameters()),
           bf16_loss_diff=abs(losses["bf16"].item() - losses["fp32"].item()),
           bf16_sharded_dtype=str(next(bf16_model.parameters()).dtype), meta=meta, device=device.type,
           backend=dist.get_backend())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
