"""Library code for lesson 11 (beyond your laptop): many ranks simulated in one process, checked.

    from helpers.scale import simulated_world, held_by_stage, collective_counts, twin_step
    with simulated_world(64, rank=0):                      # torch's "fake" process group: 64 ranks, no peers
        held = held_by_stage(layers=447, width=4096, world_size=64)   # bytes one rank holds, from torch's tensors
    collective_counts((8, 8), sequence_parallel=True)      # CommDebugMode's count of one FSDP x TP step

Three private torch tools do the simulating; each is pinned by tests/test_scale.py:
- the "fake" backend (torch/testing/_internal/distributed/fake_pg.py): a process group of one rank that
  believes it has `world_size` peers; every collective returns at once and moves no data;
- FakeTensorMode (torch/_subclasses/fake_tensor.py): tensors with shapes, dtypes and devices but no storage,
  so a 405-billion-parameter model costs kilobytes;
- LocalTensorMode (torch/distributed/_local_tensor/__init__.py): every rank's values held in one process,
  collectives computed on them, so one SPMD program runs for all ranks at once with real numbers.
Taught in notebooks/11_at_scale.ipynb.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

GB = 1e9  # the ZeRO paper and the Playbook print GB = 10**9 bytes (7.5e9 x 16 bytes = 120 GB)
STAGES = ("DP", "ZeRO-1", "ZeRO-2", "ZeRO-3")
PARTS = ("fp16 weights", "fp16 gradients", "fp32 master weights", "Adam state")


@contextlib.contextmanager
def simulated_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """A default process group of `world_size` ranks seen from `rank`, on torch's "fake" backend."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("a process group already exists in this process; destroy it first")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def stand_in(layers: int, width: int, hidden: int, dtype: torch.dtype) -> nn.Sequential:
    """`layers` Linear layers without bias, alternating width -> hidden -> width (build it under FakeTensorMode).

    The ZeRO paper's 7.5B model is 18 layers of 20032 x 20800 = 7,500,019,200 parameters: every weight's first
    dimension (the one FSDP shards) is a multiple of 64, so 64 ranks get equal shards."""
    dims = [width if i % 2 == 0 else hidden for i in range(layers + 1)]
    return nn.Sequential(*[nn.Linear(dims[i], dims[i + 1], bias=False, dtype=dtype) for i in range(layers)])


def _shard(model: nn.Sequential, mesh: Any) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh)  # one unit: FSDP2 still shards every parameter on its own (dim 0)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """What this rank stores: a DTensor's local shard, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the storage behind `tensors` on this rank, each storage counted once.

    A DTensor counts its local shard's storage: FSDP2 keeps each shard padded to ceil(rows / N) rows
    (FSDPParam._sharded_param_data in torch/distributed/fsdp/_fully_shard/_fsdp_param.py), so where N does not
    divide the rows this is more than the shard's own numel. Under FakeTensorMode no byte is allocated."""
    storages = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        storages[storage._cdata] = storage.nbytes()
    return sum(storages.values())


def _trained(model: nn.Sequential, dtype: torch.dtype, optimizer: bool) -> dict[str, list[torch.Tensor]]:
    """One forward, backward (and Adam step) on a one-row batch; the tensors torch then keeps."""
    model(torch.zeros(1, model[0].in_features, dtype=dtype)).float().sum().backward()
    params = list(model.parameters())
    kept = {"params": params, "grads": [p.grad for p in params]}
    if optimizer:
        adam = torch.optim.Adam(params)
        adam.step()
        kept["state"] = [t for p in params for t in adam.state[p].values()]  # exp_avg, exp_avg_sq, step
    return kept


def held_replicated(layers: int, width: int, hidden: int) -> dict[str, int]:
    """Bytes one data-parallel rank holds when nothing is sharded, read from torch's tensors (FakeTensorMode).

    A bf16 copy of the stand-in trained one step gives the fp16 weights and gradients; an fp32 copy trained one
    step with torch.optim.Adam gives the master weights, Adam's state (exp_avg, exp_avg_sq and a 4-byte `step`
    per tensor) and the fp32 gradients that fp32 gradient accumulation keeps. No process group needed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        half = _trained(stand_in(layers, width, hidden, torch.bfloat16), torch.bfloat16, optimizer=False)
        full = _trained(stand_in(layers, width, hidden, torch.float32), torch.float32, optimizer=True)
    return {"fp16 weights": tensor_bytes(half["params"]), "fp16 gradients": tensor_bytes(half["grads"]),
            "fp32 master weights": tensor_bytes(full["params"]), "Adam state": tensor_bytes(full["state"]),
            "fp32 gradients": tensor_bytes(full["grads"])}


def held_sharded(layers: int, width: int, hidden: int, world_size: int) -> dict[str, int]:
    """The same parts when `fully_shard` splits them over `world_size` ranks: this rank's shards' bytes.

    Run inside `simulated_world(world_size, rank)`: the fake group tells FSDP which rank this process is."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: the mesh reads its rank ids
    with FakeTensorMode():
        half = _trained(_shard(stand_in(layers, width, hidden, torch.bfloat16), mesh), torch.bfloat16, False)
        full = _trained(_shard(stand_in(layers, width, hidden, torch.float32), mesh), torch.float32, True)
    return {"fp16 weights": tensor_bytes(half["params"]), "fp16 gradients": tensor_bytes(half["grads"]),
            "fp32 master weights": tensor_bytes(full["params"]), "Adam state": tensor_bytes(full["state"]),
            "fp32 gradients": tensor_bytes(full["grads"])}


# Which parts each ZeRO stage shards (the paper's section 5: P_os, P_os+g, P_os+g+p); the rest is replicated.
SHARDED_PARTS = {"DP": set(), "ZeRO-1": {"fp32 master weights", "Adam state"},
                 "ZeRO-2": {"fp32 master weights", "Adam state", "fp16 gradients", "fp32 gradients"},
                 "ZeRO-3": {"fp32 master weights", "Adam state", "fp16 gradients", "fp32 gradients", "fp16 weights"}}


def held_by_stage(layers: int, width: int, hidden: int, world_size: int) -> dict[str, dict[str, int]]:
    """Bytes one rank holds at each ZeRO stage, part by part, from the tensors torch builds.

    Run inside `simulated_world(world_size, rank)`. Which parts each stage shards is the ZeRO paper's definition;
    every size is torch's: replicated parts from `held_replicated`, sharded ones from `held_sharded` (FSDP2's
    shards, the gradients its reduce-scatter left, the moments torch.optim.Adam made for the shards).
    PyTorch has no ZeRO-1/2 wrapper with this layout, so those two stages are assembled from the two runs."""
    replicated = held_replicated(layers, width, hidden)
    sharded = held_sharded(layers, width, hidden, world_size)
    return {stage: {part: (sharded if part in SHARDED_PARTS[stage] else replicated)[part] for part in replicated}
            for stage in STAGES}


def paper_figure_1(n_params: float, world_size: int, k: int = 12) -> dict[str, float]:
    """The ZeRO paper's Figure 1 formulas, bytes per device: (2+2+K)Psi, 2Psi+2Psi+K Psi/N, 2Psi+(2+K)Psi/N, (2+2+K)Psi/N."""
    psi, n = n_params, world_size
    return {"DP": (2 + 2 + k) * psi, "ZeRO-1": 2 * psi + 2 * psi + k * psi / n,
            "ZeRO-2": 2 * psi + (2 + k) * psi / n, "ZeRO-3": (2 + 2 + k) * psi / n}


def total(parts: dict[str, int], fp32_gradients: bool = False) -> int:
    """A stage's bytes: the paper's four parts, plus the fp32 gradients when they are accumulated in fp32."""
    return sum(parts[p] for p in PARTS) + (parts["fp32 gradients"] if fp32_gradients else 0)


def square_stand_in(n_params: float, width: int) -> tuple[int, int]:
    """(layers, width) of a stack of width x width layers closest to `n_params`."""
    return max(1, round(n_params / width**2)), width


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / reference if reference else math.inf


def twin_record(world_size: int, steps: int = 2, global_batch: int = 4,
                sequence_parallel: bool = True) -> list[dict[str, Any]]:
    """helpers.twin.tp_record for `world_size` simulated ranks in this process (fake backend + LocalTensorMode).

    Returns, per step, {"loss": {rank: tensor}, "grads": {name: {rank: tensor}}, "params": {...}}."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.transformer import batch
    from helpers.twin import tp_record

    batches = [batch(step, global_batch) for step in range(steps)]  # outside the mode: one batch for all ranks
    with simulated_world(world_size), LocalTensorMode(world_size):
        record = tp_record(init_device_mesh("cpu", (world_size,)), batches, sequence_parallel)
    return [{"loss": per_rank(entry["loss"], world_size),
             "grads": {name: per_rank(t, world_size) for name, t in entry["grads"].items()},
             "params": {name: per_rank(t, world_size) for name, t in entry["params"].items()}} for entry in record]


def per_rank(tensor: torch.Tensor, world_size: int) -> dict[int, torch.Tensor]:
    """Each simulated rank's value: a LocalTensor's `_local_tensors[rank]`, or the same plain tensor for all."""
    held = getattr(tensor, "_local_tensors", None)
    if held is None:
        return {rank: tensor for rank in range(world_size)}
    return {rank: held[rank] for rank in range(world_size)}


def compare_twin(twin: list[dict[str, Any]], real_results: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Every loss, gradient and parameter of every rank and step: torch.equal between the twin and the real run.

    Returns the number of tensors compared, how many differ, and the largest absolute difference."""
    compared, differing, largest = 0, [], 0.0
    for step, entry in enumerate(twin):
        for rank, real in real_results.items():
            pairs = [("loss", entry["loss"][rank], torch.tensor(real["steps"][step]["loss"]))]
            for kind in ("grads", "params"):
                pairs += [(f"{kind}/{name}", values[rank], torch.tensor(real["steps"][step][kind][name]))
                          for name, values in entry[kind].items()]
            for name, simulated, measured in pairs:
                simulated = simulated.to(measured.dtype)  # the loss travels as a Python float
                compared += 1
                if simulated.shape != measured.shape or not torch.equal(simulated, measured):
                    differing.append((step, rank, name))
                    if simulated.shape == measured.shape:
                        largest = max(largest, float((simulated - measured).abs().max()))
                    else:
                        largest = math.inf
    return {"compared": compared, "differing": differing, "max_abs_diff": largest}
