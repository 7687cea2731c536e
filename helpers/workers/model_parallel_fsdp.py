"""FSDP2: each rank keeps a shard of every layer; layers are all-gathered to run, gradients reduce-scattered.

    torchrun --standalone --nproc-per-node 2 helpers/workers/model_parallel_fsdp.py --steps 3

`fully_shard` is applied to every Linear layer, then to the whole model. Each rank records the shapes
it holds, counts the all-gathers and reduce-scatters of each step (by wrapping the two functions FSDP
calls), and trains a DDP copy on the same data with plain SGD: before each optimizer step it compares the
gradients (FSDP's sharded gradients gathered with full_tensor() against DDP's .grad), and after the last step
the parameters. SGD, not Adam: Adam divides each update by the root of its running squared gradient, so a
gradient twice too large moves the weights almost as much; SGD moves them twice as far. Last, one step of a
copy sharded with MixedPrecisionPolicy(param_dtype=torch.bfloat16): its all-gathers and reduce-scatters
move bf16 (2 bytes per value), and its loss is compared with the fp32 model's; one step of a copy
with reshard_after_forward=False, which gathers each layer once per step; and one step of a copy sharded
with the default reshard_after_forward=None, in which the root module owns a parameter of its own (the
output layer is not sharded separately): None means True for inner modules and False for the root
(torch/distributed/fsdp/_fully_shard/_fully_shard.py, docstring and lines 246-260; FSDPState._lazy_init in
_fsdp_state.py), so the root's group is gathered once per step. Works with one process.
"""
import argparse
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
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

    model = shard(mlp(args.width, args.hidden_layers).to(device), MixedPrecisionPolicy())
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
           bf16_sharded_dtype=str(next(bf16_model.parameters()).dtype))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
