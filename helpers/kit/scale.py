"""Worker kit: one training step's record, the same code for a real run and for its simulated twin.

    from helpers.kit.scale import tp_record
    record = tp_record(mesh, batches)     # mesh: a 1-D DeviceMesh; batches: [(inputs, targets), ...]

Lesson 10's transformer (helpers/kit/transformer.py) with its tensor-parallel plan and sequence parallelism
(`apply_tp`), trained with its AdamW on the given batches. For every step the record keeps the loss, and each
parameter's local gradient and local value after the optimizer step, and (first step only) every module's output
in the order forward produced them: on a real rank plain tensors, under
LocalTensorMode (lesson 11) LocalTensors holding every rank's values. The batches are made by the caller: under
LocalTensorMode a seeded torch.Generator would hand each simulated rank different numbers.
Taught in notebooks/11_at_scale.ipynb (helpers/workers/scale_twin.py runs it for real).
"""
from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh

from helpers.kit.tensors import local_shard
from helpers.kit.transformer import Transformer, apply_tp, loss_fn, make_optimizer


def tp_record(mesh: DeviceMesh, batches: list[tuple[torch.Tensor, torch.Tensor]],
              sequence_parallel: bool = True, count_first_step: bool = False) -> list[dict[str, Any]]:
    """Train lesson 10's transformer, tensor-parallel over `mesh`, one step per batch; return what each step left.

    count_first_step: also count the collectives of the first step (forward, backward, optimizer step) with
    CommDebugMode, as {op name: count} in record[0]["comm_counts"] (the real run does; the twin does not)."""
    import contextlib

    from torch.distributed.tensor.debug import CommDebugMode

    model = apply_tp(Transformer(seed=0).to(mesh.device_type), mesh, sequence_parallel)
    optimizer = make_optimizer(model)
    outputs: dict[str, torch.Tensor] = {}  # the first step's module outputs, in the order forward produced them

    def keep(name: str):
        def hook(module, args, output) -> None:
            if name not in outputs and isinstance(output, torch.Tensor):
                outputs[name] = local_shard(output).detach().clone()
        return hook

    hooks = [module.register_forward_hook(keep(name)) for name, module in model.named_modules() if name]
    record = []
    for inputs, targets in batches:
        counter = CommDebugMode() if count_first_step and not record else None
        with counter if counter is not None else contextlib.nullcontext():
            loss = loss_fn(model(inputs), targets)
            for handle in hooks:
                handle.remove()
            hooks = []
            loss.backward()
            grads = {name: local_shard(p.grad).clone() for name, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad()
        params = {name: local_shard(p.detach()).clone() for name, p in model.named_parameters()}
        first_step_outputs = outputs if not record else {}
        record.append({"loss": loss.detach(), "grads": grads, "params": params, "outputs": first_step_outputs})
        if counter is not None:
            record[0]["comm_counts"] = {str(op): n for op, n in counter.get_comm_counts().items()}
    return record


def order_probe(values: torch.Tensor) -> dict[str, torch.Tensor]:
    """all_reduce and reduce_scatter_single (sum) of `values`, whose float32 sum depends on the order of addition."""
    import torch.distributed as dist

    summed = values.clone()
    dist.all_reduce(summed)
    scattered = values.new_empty(values.numel() // dist.get_world_size())
    dist.reduce_scatter_single(scattered, values.clone())
    return {"all_reduce": summed, "reduce_scatter": scattered}
