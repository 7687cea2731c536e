"""Library code for lesson 11 (beyond your laptop): many ranks simulated in one process, checked.

    from helpers.lessons.scale import simulated_world, held_by_stage, collective_counts, twin_record, plan
    with simulated_world(64, rank=0):                   # torch's "fake" process group: 64 ranks, no peers
        held = held_by_stage(18, 20032, 20800, world_size=64)   # bytes one rank holds, from torch's tensors
    collective_counts((8, 8), sequence_parallel=True)   # CommDebugMode's count of one FSDP x TP step
    twin_record(4)                                      # lesson 10's TP step for 4 ranks under LocalTensorMode
    plan(7.5e9, dp=64, stage="ZeRO-3")                   # our formulas, checked in the lesson against the above

Three private torch tools do the simulating; each is pinned by tests/test_scale.py:
- the "fake" backend (torch/testing/_internal/distributed/fake_pg.py): a process group of one rank that
  believes it has `world_size` peers; every collective returns at once and moves no data;
- FakeTensorMode (torch/_subclasses/fake_tensor.py): tensors with shapes, dtypes and devices but no storage,
  so no tensor's values take memory, whatever its size;
- LocalTensorMode (torch/distributed/_local_tensor/__init__.py): every rank's values held in one process,
  collectives computed on them, so one SPMD program runs for all ranks at once with real numbers.
Taught in notebooks/11_at_scale.ipynb.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from helpers.kit.tensors import storage_bytes

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

    Lesson 11's stand-in for the ZeRO paper's 7.5B model is 18 layers of 20032 x 20800 = 7,499,980,800 parameters:
    every weight's first dimension (the one FSDP shards) is a multiple of 64, so 64 ranks get equal shards."""
    dims = [width if i % 2 == 0 else hidden for i in range(layers + 1)]
    return nn.Sequential(*[nn.Linear(dims[i], dims[i + 1], bias=False, dtype=dtype) for i in range(layers)])


def _shard(model: nn.Sequential, mesh: Any) -> nn.Sequential:
    from torch.distributed.fsdp import fully_shard

    return fully_shard(model, mesh=mesh)  # one unit: FSDP2 still shards every parameter on its own (dim 0)


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
    return {"fp16 weights": storage_bytes(half["params"]), "fp16 gradients": storage_bytes(half["grads"]),
            "fp32 master weights": storage_bytes(full["params"]), "Adam state": storage_bytes(full["state"]),
            "fp32 gradients": storage_bytes(full["grads"])}


def held_sharded(layers: int, width: int, hidden: int, world_size: int) -> dict[str, int]:
    """The same parts when `fully_shard` splits them over `world_size` ranks: this rank's shards' bytes.

    Run inside `simulated_world(world_size, rank)`: the fake group tells FSDP which rank this process is."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,))  # outside FakeTensorMode: the mesh reads its rank ids
    with FakeTensorMode():
        half = _trained(_shard(stand_in(layers, width, hidden, torch.bfloat16), mesh), torch.bfloat16, False)
        full = _trained(_shard(stand_in(layers, width, hidden, torch.float32), mesh), torch.float32, True)
    return {"fp16 weights": storage_bytes(half["params"]), "fp16 gradients": storage_bytes(half["grads"]),
            "fp32 master weights": storage_bytes(full["params"]), "Adam state": storage_bytes(full["state"]),
            "fp32 gradients": storage_bytes(full["grads"])}


# Which parts each ZeRO stage shards (the paper's section 5: P_os, P_os+g, P_os+g+p); the rest is replicated.
SHARDED_PARTS = {"DP": set(), "ZeRO-1": {"fp32 master weights", "Adam state"},
                 "ZeRO-2": {"fp32 master weights", "Adam state", "fp16 gradients", "fp32 gradients"},
                 "ZeRO-3": {"fp32 master weights", "Adam state", "fp16 gradients", "fp32 gradients", "fp16 weights"}}


def held_by_stage(layers: int, width: int, hidden: int, world_size: int) -> dict[str, dict[str, int]]:
    """Bytes one rank holds at each ZeRO stage, part by part, from the tensors torch builds.

    Run inside `simulated_world(world_size, rank)`. Which parts each stage shards is the ZeRO paper's definition;
    every size is torch's: replicated parts from `held_replicated`, sharded ones from `held_sharded` (FSDP2's
    shards, the gradients its reduce-scatter left, the moments torch.optim.Adam made for the shards).
    PyTorch has no ZeRO-1/2 wrapper with this layout, so those two stages are assembled from the two runs: this is
    the paper's accounting (a separate bf16 copy of weights and gradients) applied to torch's tensor sizes, not the
    layout any torch setup keeps (autocast and FSDP2's MixedPrecisionPolicy keep fp32 weights and gradients)."""
    replicated = held_replicated(layers, width, hidden)
    sharded = held_sharded(layers, width, hidden, world_size)
    return {stage: {part: (sharded if part in SHARDED_PARTS[stage] else replicated)[part] for part in replicated}
            for stage in STAGES}


def stages_figure(held: dict[str, dict[str, int]]) -> Any:
    """One rank's bytes at each ZeRO stage, part by part: the parts FSDP2 sharded (their sizes torch's) solid, the
    parts the stage keeps whole on every rank (the paper's definition, our SHARDED_PARTS table) hatched."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 2.8))
    colours = dict(zip(PARTS, ("tab:blue", "tab:orange", "tab:green", "tab:red"), strict=True))
    for y, stage in enumerate(STAGES):
        left = 0.0
        for part in PARTS:
            value = held[stage][part] / GB
            sharded = part in SHARDED_PARTS[stage]
            ax.barh(y, value, left=left, color=colours[part], alpha=1 if sharded else 0.35,
                    hatch=None if sharded else "//", edgecolor="white" if sharded else colours[part],
                    label=part if y == 0 else None)
            left += value
        shards = sum(held[stage][p] for p in PARTS if p in SHARDED_PARTS[stage]) / GB
        ax.text(left, y, f"  {left:.3g} GB, of which {shards:.3g} in FSDP2's shards", va="center", fontsize="small")
    ax.set_yticks(range(len(STAGES)), STAGES)
    ax.invert_yaxis()
    ax.set(xlabel="GB (10^9 bytes) one rank keeps", xlim=(0, 175),
           title="7.5B parameters on 64 ranks: hatched = kept whole on every rank, solid = FSDP2's 1/64 shard")
    ax.legend(fontsize="x-small", loc="lower right")
    fig.tight_layout()
    return fig


def shard_sweep(layers: int, width: int, hidden: int, world_sizes: tuple[int, ...] = (64, 128, 256, 512),
                say: Any = print) -> dict[tuple[int, int], dict[str, int]]:
    """held_sharded for the first and the last rank of each world size, one line printed as each size is done."""
    n_params = layers * width * hidden
    say(f"{'ranks':>6}{'16 Psi / N':>12}{'rank 0':>10}{'last rank':>11}   GB per rank at ZeRO-3", flush=True)
    sweep = {}
    for world_size in world_sizes:
        for rank in (0, world_size - 1):
            with simulated_world(world_size, rank=rank):
                sweep[world_size, rank] = held_sharded(layers, width, hidden, world_size)
        first, last = total(sweep[world_size, 0]), total(sweep[world_size, world_size - 1])
        say(f"{world_size:>6}{16 * n_params / world_size / GB:>12.4f}{first / GB:>10.4f}{last / GB:>11.4f}", flush=True)
    return sweep


def sweep_figure(sweep: dict[tuple[int, int], dict[str, int]], n_params: int) -> Any:
    """GB per rank at ZeRO-3 against the number of ranks: the first and the last rank, and 16 Psi / N."""
    import matplotlib.pyplot as plt

    sizes = sorted({n for n, _ in sweep})
    fig, ax = plt.subplots(figsize=(5.5, 3))
    ax.plot(sizes, [16 * n_params / n / GB for n in sizes], "k--", label="16 Psi / N (even split)")
    ax.plot(sizes, [total(sweep[n, 0]) / GB for n in sizes], "o-", label="rank 0")
    ax.plot(sizes, [total(sweep[n, n - 1]) / GB for n in sizes], "s-", label="last rank")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.minorticks_off()
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.yaxis.set_major_formatter(plt.FuncFormatter(lambda value, _: f"{value:g}"))
    ax.set(xlabel="ranks N", ylabel="GB one rank keeps", title="ZeRO-3 shards of the stand-in, from FSDP2")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def paper_figure_1(n_params: float, world_size: int, k: int = 12) -> dict[str, float]:
    """The ZeRO paper's Figure 1 formulas, bytes per device:
    (2+2+K) Psi, 2 Psi + 2 Psi + K Psi / N, 2 Psi + (2+K) Psi / N, (2+2+K) Psi / N."""
    psi, n = n_params, world_size
    return {"DP": (2 + 2 + k) * psi, "ZeRO-1": 2 * psi + 2 * psi + k * psi / n,
            "ZeRO-2": 2 * psi + (2 + k) * psi / n, "ZeRO-3": (2 + 2 + k) * psi / n}


def total(parts: dict[str, int], fp32_gradients: bool = False) -> int:
    """A stage's bytes: the paper's four parts, plus the fp32 gradients when they are accumulated in fp32."""
    return sum(parts[p] for p in PARTS) + (parts["fp32 gradients"] if fp32_gradients else 0)


def relative_error(value: float, reference: float) -> float:
    return abs(value - reference) / reference if reference else math.inf


def zero_redundancy_held(shapes: list[tuple[int, int]], world_size: int, ranks: Any) -> dict[int, dict[str, int]]:
    """Torch's ZeRO-1, measured: for each rank in `ranks`, build `ZeroRedundancyOptimizer` (Adam) on the fake
    backend over fp32 parameters of `shapes`, take one step, and read what that rank's optimizer holds:
    {"params": elements of the parameters it owns, "moment elements": elements of Adam's exp_avg and exp_avg_sq}.
    Real (small) tensors: the fake group moves no data, so only sizes mean anything."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    held = {}
    for rank in ranks:
        with simulated_world(world_size, rank=rank):
            params = [nn.Parameter(torch.zeros(shape)) for shape in shapes]
            optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.Adam, lr=1e-3)
            for p in params:
                p.grad = torch.ones_like(p)
            optimizer.step()
            local = optimizer.optim  # the Adam over this rank's partition only
            owned = [p for group in local.param_groups for p in group["params"]]
            moments = sum(state[key].numel() for state in local.state.values()
                          for key in ("exp_avg", "exp_avg_sq") if key in state)
            held[rank] = {"params": sum(p.numel() for p in owned), "moment elements": moments}
    return held


def twin_record(world_size: int, steps: int = 2, global_batch: int = 4,
                sequence_parallel: bool = True) -> list[dict[str, Any]]:
    """helpers.kit.scale.tp_record for `world_size` simulated ranks in this process (fake backend + LocalTensorMode).

    Returns, per step, {"loss": {rank: tensor}, "grads": {name: {rank: tensor}}, "params": {...}}."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.kit.scale import tp_record
    from helpers.kit.transformer import batch

    batches = [batch(step, global_batch) for step in range(steps)]  # outside the mode: one batch for all ranks
    with simulated_world(world_size), LocalTensorMode(world_size):
        record = tp_record(init_device_mesh("cpu", (world_size,)), batches, sequence_parallel)
    return [{"loss": per_rank(entry["loss"], world_size),
             "outputs": {name: per_rank(t, world_size) for name, t in entry["outputs"].items()},
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
        for rank, real in sorted(real_results.items()):
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


# --- traffic: collectives per training step, counted by CommDebugMode under the fake backend --------------------

# FSDP2 calls dist.all_gather_single / dist.reduce_scatter_single (fsdp/_fully_shard/_fsdp_collectives.py:119, :184),
# which dispatch c10d's _allgather_base_ / _reduce_scatter_base_. DTensor's redistributions call the functional
# collectives (tensor/placement_types.py:509, :609, :1806). CommDebugMode counts both families.
_OP_NAMES = {"c10d._allgather_base_": ("dp", "all_gather"), "c10d._reduce_scatter_base_": ("dp", "reduce_scatter"),
             "c10d_functional.all_gather_into_tensor": ("tp", "all_gather"),
             "c10d_functional.reduce_scatter_tensor": ("tp", "reduce_scatter"),
             "c10d_functional.all_reduce": ("tp", "all_reduce")}


def model_for(tp: int, blocks: int) -> Any:
    """Lesson 10's transformer with enough heads for `tp` tensor-parallel ranks (each rank needs whole heads)."""
    from helpers.kit.transformer import Transformer

    heads = max(4, tp)
    return Transformer(dim=16 * heads, heads=heads, hidden=64 * heads, blocks=blocks, seed=0)


def _fsdp_tp_with(model: Any, mesh: Any, tp_plan: tuple[dict, dict]) -> Any:
    """apply_fsdp_tp with another tensor-parallel plan: (top-level plan, plan for each block) over mesh["tp"], then
    FSDP2 over mesh["dp"]."""
    from torch.distributed.tensor.parallel import parallelize_module

    from helpers.kit.transformer import apply_fsdp

    parallelize_module(model, mesh["tp"], tp_plan[0])
    for block in model.layers.values():
        parallelize_module(block, mesh["tp"], tp_plan[1])
    return apply_fsdp(model, mesh["dp"])


def collective_counts(mesh_shape: tuple[int, int], sequence_parallel: bool = True, blocks: int = 2,
                      rank: int = 0, tp_plan: tuple[dict, dict] | None = None) -> dict[str, dict[str, int]]:
    """Collectives of one training step of lesson 10's FSDP x TP layout on a (dp, tp) mesh, seen by `rank`.

    Real (small) tensors on the fake backend: every collective returns at once without moving data, so the values
    are wrong but every call torch makes is made. The second step is counted (the first also initialises FSDP).
    tp_plan: (top-level plan, plan for each block) to use instead of lesson 10's (e.g. plan_without_prepare())."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from helpers.kit.transformer import apply_fsdp_tp, batch, make_optimizer, rows, train_step

    dp, tp = mesh_shape
    # lesson 10's Transformer returns a view from its root FSDP module; FSDP2 warns about in-place ops on it, and
    # train_step makes none (fsdp/_fully_shard/_fsdp_state.py:448-449)
    with simulated_world(dp * tp, rank), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh("cpu", mesh_shape, mesh_dim_names=("dp", "tp"))
        if tp_plan is None:
            model = apply_fsdp_tp(model_for(tp, blocks), mesh, sequence_parallel)
        else:
            model = _fsdp_tp_with(model_for(tp, blocks), mesh, tp_plan)
        optimizer = make_optimizer(model)
        inputs, targets = batch(0, dp)
        inputs, targets = rows(inputs, 0, dp), rows(targets, 0, dp)
        train_step(model, optimizer, inputs, targets)
        with CommDebugMode() as counter:
            train_step(model, optimizer, inputs, targets)
    counts: dict[str, dict[str, int]] = {"dp": {}, "tp": {}}
    for op, count in counter.get_comm_counts().items():
        dim, name = _OP_NAMES[str(op)]  # an op not in the table raises KeyError: a torch change to look at
        counts[dim][name] = counts[dim].get(name, 0) + count
    return counts


def counts_figure(counts: dict[tuple[int, int], dict[str, dict[str, int]]]) -> Any:
    """Collectives per step on each mesh dimension, one group of bars per mesh (from collective_counts)."""
    import matplotlib.pyplot as plt

    keys = sorted({(dim, op) for measured in counts.values() for dim in measured for op in measured[dim]})
    fig, ax = plt.subplots(figsize=(7, 2.6))
    width = 0.8 / len(counts)
    for i, (shape, measured) in enumerate(counts.items()):
        ax.bar([k + i * width for k in range(len(keys))], [measured[dim].get(op, 0) for dim, op in keys], width,
               label=f"mesh {shape}, {shape[0] * shape[1]} ranks")
    ax.set_xticks([k + width * (len(counts) - 1) / 2 for k in range(len(keys))],
                  [f"{dim}\n{op.replace('_', ' ')}" for dim, op in keys], fontsize="small")
    ax.set(ylabel="calls per step", title="one FSDP x TP training step, counted by CommDebugMode")
    ax.legend(fontsize="small")
    fig.tight_layout()
    return fig


def named_counts(comm_counts: dict[str, int]) -> dict[str, int]:
    """CommDebugMode's {op: count} (op as a string) as {"all_gather": ..., ...}; an unknown op raises KeyError."""
    named: dict[str, int] = {}
    for op, count in comm_counts.items():
        name = _OP_NAMES[str(op)][1]
        named[name] = named.get(name, 0) + count
    return dict(sorted(named.items()))


def tp_step_counts(world_size: int, replicate_grads: bool = False) -> dict[str, dict[str, int]]:
    """The twin's layout (lesson 10's TP plan with SP on a 1-D mesh, no FSDP) on the fake backend: the first step's
    collectives, counted apart for forward + backward and for the optimizer step (CommDebugMode).

    replicate_grads: after backward, turn every gradient left Partial (the norm weights') into Replicate once, so
    that the optimizer reads a summed gradient instead of summing it again at each of its reads."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.debug import CommDebugMode

    from helpers.kit.transformer import Transformer, apply_tp, batch, loss_fn, make_optimizer

    with simulated_world(world_size):
        model = apply_tp(Transformer(seed=0), init_device_mesh("cpu", (world_size,)), True)
        optimizer = make_optimizer(model)
        inputs, targets = batch(0, 4)
        with CommDebugMode() as passes:
            loss_fn(model(inputs), targets).backward()
            for p in model.parameters():
                if replicate_grads and isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
                    p.grad = p.grad.redistribute(placements=[Replicate()] * p.grad.device_mesh.ndim)
        with CommDebugMode() as update:
            optimizer.step()
    return {"forward+backward": named_counts(passes.get_comm_counts()),
            "optimizer": named_counts(update.get_comm_counts())}


def tp_collectives(blocks: int) -> dict[str, int]:
    """Our formula for the tensor-parallel collectives of one step of lesson 10's plan with sequence parallelism
    (helpers.kit.transformer.tp_plan). The same plan without its PrepareModuleInput entries is the lesson's exercise.

    Each block all-gathers its attention and MLP inputs and reduce-scatters their outputs, forward and again
    (mirrored) in backward: 4 of each per block; the embedding's output adds a reduce-scatter (forward) and an
    all-gather (backward), the output layer an all-gather of its input and one of the logits (forward) and a
    reduce-scatter (backward); each norm weight's gradient is all-reduced (2 per block + 1)."""
    return {"all_gather": 4 * blocks + 3, "reduce_scatter": 4 * blocks + 2, "all_reduce": 2 * blocks + 1}


def fsdp_collectives(blocks: int) -> dict[str, int]:
    """Our formula for FSDP2's collectives per step, one unit per block plus the root (transformer.apply_fsdp).

    Forward gathers every unit; backward gathers the blocks again (reshard_after_forward=None means True for
    non-root units and False for the root: fsdp/_fully_shard/_fully_shard.py:180-190); every unit reduce-scatters
    once."""
    return {"all_gather": 2 * blocks + 1, "reduce_scatter": blocks + 1}


def plan_without_prepare() -> tuple[dict, dict]:
    """The exercise's plan: lesson 10's tensor-parallel plan with sequence parallelism (transformer.tp_plan), less its
    two PrepareModuleInput entries. Each column-wise layer of a block then takes the sequence-sharded input itself:
    ColwiseParallel(input_layouts=Shard(1)) for wq, wk, wv and w1. Returns (top-level plan, plan for each block)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    from helpers.kit.transformer import tp_plan

    top, block = tp_plan(sequence_parallel=True)
    block = {name: style for name, style in block.items() if not isinstance(style, PrepareModuleInput)}
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1"):
        block[name] = ColwiseParallel(input_layouts=Shard(1))
    return top, block


_TP_PHASE_COUNTS: dict[int, tuple] = {}


def _tp_phase_counts_cached(blocks: int) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """_tp_phase_counts_measured(blocks), measured once per block count. A plain function with its own dict, not
    functools.cache: a cached call must still run a Python frame, or the exercise's watch (_counter_called) would not
    see a tp_counts that asks the answer key after an earlier check filled the cache."""
    if blocks not in _TP_PHASE_COUNTS:
        _TP_PHASE_COUNTS[blocks] = _tp_phase_counts_measured(blocks)
    return _TP_PHASE_COUNTS[blocks]


def _tp_phase_counts_measured(blocks: int) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """CommDebugMode's tp collectives, forward and backward apart, of lesson 10's FSDP x TP layout with the exercise's
    plan (plan_without_prepare) on a (2, 2) mesh of fake ranks. The first step is counted: FSDP2's lazy
    initialisation runs no tp collective (its own, on dp, are c10d ops and left out)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from helpers.kit.transformer import batch, loss_fn, rows

    with simulated_world(4), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = _fsdp_tp_with(model_for(2, blocks), mesh, plan_without_prepare())
        inputs, targets = (rows(t, 0, 2) for t in batch(0, 2))
        with CommDebugMode() as forward:
            loss = loss_fn(model(inputs), targets)
        with CommDebugMode() as backward:
            loss.backward()
    counted = []
    for phase, mode in (("forward", forward), ("backward", backward)):
        on_tp = {str(op): n for op, n in mode.get_comm_counts().items() if _OP_NAMES[str(op)][0] == "tp"}
        counted.append((phase, tuple(sorted(named_counts(on_tp).items()))))
    return tuple(counted)


def tp_phase_counts(blocks: int) -> dict[str, dict[str, int]]:
    """Torch's tp collectives for the exercise's plan, {"forward": {...}, "backward": {...}} (measured once): the
    checker's answer key, which the lesson's hints ask learners not to call."""
    return {phase: dict(counts) for phase, counts in _tp_phase_counts_cached(blocks)}


def _counts_of(answer: Any) -> dict[str, dict[str, int]]:
    """A learner's {"forward": {...}, "backward": {...}}, zero counts dropped; ValueError if it has another shape."""
    if not isinstance(answer, dict) or set(answer) != {"forward", "backward"}:
        raise ValueError
    return {phase: {op: int(n) for op, n in dict(answer[phase]).items() if n} for phase in ("forward", "backward")}


# What to look at when a count is off: where the phase's collectives come from, asked, not answered.
_LOOK_AT = {"forward": "walk one block's forward layer by layer: what layout does each layer's input arrive in, and "
                       "what layout does that layer's plan entry ask for?",
            "backward": "backward sends a gradient back through every redistribution forward made, in the opposite "
                        "direction (the gradient of an all-gather is a reduce-scatter, and the reverse).",
            # the backward all-reduces come from no redistribution: the norm weights' Partial(sum) gradients
            ("backward", "all_reduce"): "look at the parameters the plan leaves replicated on tp (the norms): each "
                                        "rank's gradient of such a weight is a partial sum, and it must be summed "
                                        "over tp."}


def _look_at(phase: str, op: str) -> str:
    """Where to look when the learner's count of `op` in `phase` is off."""
    return _LOOK_AT.get((phase, op), _LOOK_AT[phase])


_TOLD_WHICH_WAY: set[tuple[str, str, str]] = set()  # (phase, op, part) whose miss this kernel heard "too low/high"


def _which_way(phase: str, op: str, part: str, low: bool) -> str:
    """'too low' or 'too high' the first time this kernel misses (phase, op, part); afterwards only 'still wrong', so
    the direction cannot be followed edit by edit to the answer without reading the plan."""
    if (phase, op, part) in _TOLD_WHICH_WAY:
        return "still wrong (which way was said once; count it from the plan rather than by trial)"
    _TOLD_WHICH_WAY.add((phase, op, part))
    return f"too {'low' if low else 'high'}"


def _where_it_differs(yours: dict[int, dict], torch_counts: dict[int, dict]) -> str | None:
    """What is wrong with the learner's counts for 1, 2 and 3 blocks, in words, without torch's numbers (which way a
    count is off only the first time that count misses)."""
    for phase in ("forward", "backward"):
        ops = {op for b in yours for op in {**yours[b][phase], **torch_counts[b][phase]}}
        # a collective torch never ran in this phase is the first thing to hear about, then the others by name
        ops = sorted(ops, key=lambda op: (any(torch_counts[b][phase].get(op, 0) for b in (1, 2, 3)), op))
        for op in ops:
            mine = [yours[b][phase].get(op, 0) for b in (1, 2, 3)]
            real = [torch_counts[b][phase].get(op, 0) for b in (1, 2, 3)]
            if mine == real:
                continue
            if not any(real):
                return f"torch ran no {op} in {phase}; your counts have some."
            if not any(mine):
                return f"your {phase} has no {op}; torch ran some. To see where: {_look_at(phase, op)}"
            if mine[1] - mine[0] != mine[2] - mine[1]:
                return (f"your {phase} count of {op} does not grow by the same amount with each block, and every "
                        "block has the same layers.")
            slope, torch_slope = mine[1] - mine[0], real[1] - real[0]
            if slope != torch_slope:
                return (f"per block, your {phase} count of {op} is "
                        f"{_which_way(phase, op, 'per block', slope < torch_slope)}. To see why, {_look_at(phase, op)}")
            return (f"per block your {phase} count of {op} is right, but the part outside the blocks is "
                    f"{_which_way(phase, op, 'outside', mine[0] < real[0])}: look at the embedding, the final norm "
                    "and the output layer.")
    return None


# The functions of this module that run torch to count the exercise's collectives (the checker's answer key among
# them): a tp_counts that calls one, or enters torch's CommDebugMode, has the counts made for it instead of derived.
_COUNTERS = {"collective_counts", "tp_phase_counts", "_tp_phase_counts_cached", "_tp_phase_counts_measured",
             "tp_step_counts", "_fsdp_tp_with", "simulated_world"}


def _counter_called(call: Any) -> tuple[Any, str | None]:
    """call() with a profiler watching: (its result, the name of the first counting function it called, or None).

    Counting functions: this module's _COUNTERS, and anything in torch's CommDebugMode (debug/_comm_mode.py)."""
    import sys

    seen: list[str] = []
    here = __file__

    def watch(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and not seen:
            code = frame.f_code
            if code.co_filename == here and code.co_name in _COUNTERS:
                seen.append(code.co_name)
            elif code.co_filename.replace("\\", "/").endswith("torch/distributed/tensor/debug/_comm_mode.py"):
                seen.append("torch's CommDebugMode")

    before = sys.getprofile()
    sys.setprofile(watch)
    try:
        result = call()
    finally:
        sys.setprofile(before)
    return result, (seen[0] if seen else None)


def check_tp_counts(tp_counts: Any) -> bool:
    """The exercise: `tp_counts(blocks)` -> {"forward": {...}, "backward": {...}}, the tp collectives of one training
    step of lesson 10's FSDP x TP layout with the plan without PrepareModuleInput (plan_without_prepare), checked
    against torch's counts for 1, 2 and 3 blocks. A wrong answer hears where it differs (which phase and collective,
    per block or outside the blocks), not torch's numbers: the exercise is to derive them from the plan."""
    import traceback

    from helpers.lessons.checks import correct, not_yet

    print("Counting torch's collectives for 1, 2 and 3 blocks on a (2, 2) mesh of fake ranks (a few seconds the "
          "first time)...", flush=True)
    yours, real = {}, {}
    for blocks in (1, 2, 3):
        try:
            answer, counter = _counter_called(functools.partial(tp_counts, blocks))
            if counter:
                return not_yet(f"tp_counts({blocks}) called {counter}, which runs torch and counts the collectives "
                               "for you. Derive them instead: formulas in the number of blocks, from the plan, layer "
                               "by layer.")
            yours[blocks] = _counts_of(answer)
        except ValueError:
            return not_yet(f"tp_counts({blocks}) should return {{'forward': {{...}}, 'backward': {{...}}}}, each a "
                           "dict of collective names (all_reduce, all_gather, reduce_scatter) to counts.")
        except Exception as error:
            frame = traceback.extract_tb(error.__traceback__)[-1]
            return not_yet(f"tp_counts({blocks}) raised {type(error).__name__}: {error} (line {frame.lineno} of "
                           f"your cell: {frame.line})")
        real[blocks] = tp_phase_counts(blocks)
    wrong = _where_it_differs(yours, real)
    if wrong:
        return not_yet(wrong)
    per_block = sum(sum(real[2][phase].values()) - sum(real[1][phase].values()) for phase in real[1])
    extra = per_block - (sum(tp_collectives(2).values()) - sum(tp_collectives(1).values()))  # section 3's plan
    return correct(f"your counts match CommDebugMode's, forward and backward, for 1, 2 and 3 blocks. Without "
                   f"PrepareModuleInput every block runs {extra} tp collectives more than with it (section 3's plan).")


class _FullTensorBytes:
    """Ours, a TorchDispatchMode made on first use: the calls and the full-tensor bytes of FSDP2's c10d collectives
    (an all-gather's output, a reduce-scatter's input), as lesson 10's worker counts them."""

    @staticmethod
    def make() -> Any:
        from torch.utils._python_dispatch import TorchDispatchMode

        class FullTensorBytes(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.calls: dict[str, int] = {}
                self.bytes: dict[str, int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = {"_allgather_base_": "all_gather", "_reduce_scatter_base_": "reduce_scatter"}.get(
                    func.__name__.split(".")[0])
                if name is not None:
                    full = args[0] if name == "all_gather" else args[1]
                    self.calls[name] = self.calls.get(name, 0) + 1
                    self.bytes[name] = self.bytes.get(name, 0) + full.numel() * full.element_size()
                return func(*args, **(kwargs or {}))

        return FullTensorBytes()


def fsdp_dp_traffic(world_size: int = 8, microbatches: int = 1, reduce_dtype: torch.dtype = torch.bfloat16,
                    regather: bool = True, reduce_every_microbatch: bool = True, layers: int = 4,
                    width: int = 64) -> dict[str, Any]:
    """FSDP2's own data-parallel collectives for one training step of `microbatches` micro-batches, on the fake
    backend: `layers` bias-free Linear(width, width) layers, each its own unit, under a root with no parameters of
    its own, with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=reduce_dtype), reshard_after_forward=regather;
    without reduce_every_microbatch, set_requires_gradient_sync(False) until the last micro-batch.
    Returns the calls and full-tensor bytes of each collective (counted by our dispatch mode), and Psi."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    with simulated_world(world_size):
        mesh = init_device_mesh("cpu", (world_size,))
        model = nn.Sequential(*[nn.Linear(width, width, bias=False) for _ in range(layers)])
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        for layer in model:
            fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=regather)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        inputs = torch.randn(2, width)
        model(inputs).float().sum().backward()  # the first step also initialises FSDP: not counted
        with _FullTensorBytes.make() as counter:
            for micro in range(microbatches):
                if not reduce_every_microbatch:
                    model.set_requires_gradient_sync(micro == microbatches - 1)
                model(inputs).float().sum().backward()
    return {"calls": counter.calls, "bytes": counter.bytes, "n_params": layers * width * width}


# --- the control for the twin: in which order does each backend add up four ranks? ------------------------------

# 2**24 + 1 rounds back to 2**24 in float32, so the sum depends on the order: (((a + b) + c) + d) = 1 in rank order.
ORDER_PROBE = (2.0**24, 1.0, -(2.0**24), 1.0)


def order_probe_twin(world_size: int = 4) -> dict[str, list[float]]:
    """all_reduce and reduce_scatter of ORDER_PROBE under LocalTensorMode (rank r contributes ORDER_PROBE[r])."""
    from torch.distributed._local_tensor import LocalTensorMode

    from helpers.kit.scale import order_probe

    with simulated_world(world_size), LocalTensorMode(world_size) as mode:
        inputs = mode.rank_map(lambda rank: torch.full((world_size,), ORDER_PROBE[rank % len(ORDER_PROBE)]))
        summed = order_probe(inputs)
    return {name: [per_rank(t, world_size)[rank].tolist() for rank in range(world_size)] for name, t in summed.items()}


# --- the planner: our formulas, checked against the simulations above -------------------------------------------

def dp_traffic(psi: float, dp: int, stage: str, microbatches: int = 1, reduce_bytes: int = 2, regather: bool = True,
               reduce_every_microbatch: bool = True) -> float:
    """Bytes one rank sends per step on the data-parallel dimension (ring: (dp - 1) / dp of each full tensor), for
    Psi' parameters kept in bf16 (2 bytes) whose gradients are reduced in `reduce_bytes` per value (2: bf16; 4: fp32,
    torchtitan's default reduce dtype).
    DP: the gradients all-reduced (a reduce-scatter and an all-gather). ZeRO-1 and ZeRO-2: the gradients
    reduce-scattered, the updated weights all-gathered once per step. ZeRO-3 (FSDP2): the weights all-gathered before
    each micro-batch's forward and, with `regather` (FSDP2's default reshard_after_forward for every unit but the
    root), again before its backward; the gradients reduce-scattered.
    The gradients are reduced after every micro-batch's backward (FSDP2's default) unless reduce_every_microbatch is
    False (DDP's no_sync, FSDP2's set_requires_gradient_sync(False) until the last micro-batch): then once per step.
    Checked against FSDP2's own collectives in lesson 11 (fsdp_dp_traffic); a root that holds parameters is not
    gathered again in backward, which this formula leaves out."""
    ring = (dp - 1) / dp
    reductions = microbatches if reduce_every_microbatch else 1
    if stage == "DP":
        return ring * 2 * reduce_bytes * psi * reductions
    if stage in ("ZeRO-1", "ZeRO-2"):
        return ring * (reduce_bytes * psi * reductions + 2 * psi)
    return ring * (2 * psi * microbatches * (2 if regather else 1) + reduce_bytes * psi * reductions)


def ring_attention_bytes(tokens: float, kv_hidden: int, cp: int, bytes_per_value: int = 2,
                         gradient_bytes_per_value: int = 4) -> float:
    """Bytes one rank sends for one attention layer and one micro-batch under torch's ring attention over `cp` ranks,
    forward and backward. Its keys and values, kv = 2 x tokens / cp x kv_hidden values, travel cp - 1 times in
    forward and cp - 1 times again in backward, in the model's dtype (`bytes_per_value`); their gradients travel cp
    times (the last pass brings them home) in the dtype torch accumulates them in: float32 by default
    (`_cp_options.convert_to_f32`), so `gradient_bytes_per_value` = 4 whatever the model's dtype.
    float32: (3 cp - 2) x kv x 4 bytes; bfloat16: 2 (cp - 1) x kv x 2 + cp x kv x 4 = (4 cp - 2) x kv x 2 bytes.
    An all-gather of k and v sends the same bytes (each rank's block reaches the cp - 1 others); it holds more."""
    if cp == 1:
        return 0.0
    kv = 2 * tokens / cp * kv_hidden
    return (2 * (cp - 1) * bytes_per_value + cp * gradient_bytes_per_value) * kv


def moe_all_to_all_bytes(tokens: float, hidden: int, ep: int, top_k: int = 2, bytes_per_value: int = 2) -> float:
    """Bytes one rank sends in ONE token all-to-all of a mixture-of-experts layer over `ep` ranks, with every expert
    equally loaded: each of its tokens goes to top_k experts, (ep - 1) / ep of them on other ranks. A step has four
    (dispatch and combine, forward and backward); the count exchange before them is a few bytes per expert."""
    return tokens * top_k * hidden * bytes_per_value * (ep - 1) / ep


def attention_saved_bytes(tokens: float, hidden: int, heads: int, cp: int = 1, bytes_per_value: int = 2,
                          lse_bytes: int = 4, kv_hidden: int | None = None) -> float:
    """Bytes one rank keeps for backward from one attention layer with a fused (flash) kernel: q, k, v and the output
    of its tokens / cp tokens, and one log-sum-exp per token and head. Linear in the tokens, divided by cp. kv_hidden:
    the width of k and v (smaller with grouped-query attention; `hidden` by default)."""
    kv_hidden = hidden if kv_hidden is None else kv_hidden
    return tokens / cp * ((2 * hidden + 2 * kv_hidden) * bytes_per_value + heads * lse_bytes)


def plan(n_params: float, dp: int, tp: int = 1, pp: int = 1, microbatches: int = 1, stage: str = "ZeRO-3",
         fp32_gradients: bool = False, blocks: int = 2, tokens: int = 4096, hidden: int = 4096, cp: int = 1,
         ep: int = 1, expert_params: float = 0.0, top_k: int = 2, heads: int = 32, reduce_bytes: int = 2,
         regather: bool = True, reduce_every_microbatch: bool = True, kv_heads: int | None = None) -> dict[str, Any]:
    """Our planner for a dp x tp x pp x cp layout, ep carved from the dp x cp ranks, with ZeRO `stage` (formulas, not
    measurements).

    memory: bytes per rank by part, the ZeRO paper's accounting (plus fp32 gradients, 4 bytes, sharded from ZeRO-2
    on, as the Playbook notes); activations are not counted. A rank holds dense / (tp x pp) dense parameters and
    expert_params / (tp x pp x ep) expert parameters. The cp ranks hold the same weights as the dp ranks (they split
    the sequence, not the model), so ZeRO shards the dense parameters over dp x cp ranks; each expert lives on
    dp x cp / ep ranks, and ZeRO shards it over those (torchtitan's fsdp = dp_shard x cp and efsdp = fsdp / ep).
    traffic: bytes each rank sends per step on each mesh dimension, ring algorithms ((n-1)/n of the data per
    all-gather or reduce-scatter, twice that per all-reduce); dp: `dp_traffic` over the ranks that hold the same
    weights, dp x cp for the dense parameters and dp x cp / ep for the experts' (gradients in `reduce_bytes` per value,
    per micro-batch or once per step; at ZeRO-3 the bf16 weights gathered once or twice per micro-batch); tp moves the
    activations (tokens / cp x hidden x 2 bytes per micro-batch) 8 times per block with sequence parallelism; pp sends
    one activation forward and one gradient back per micro-batch; cp: torch's ring attention, ring_attention_bytes per
    block (bf16 k and v, float32 gradients), with `kv_heads` key/value heads of `heads` (grouped-query attention; all
    of them by default); ep: four token all-to-alls per block, moe_all_to_all_bytes (every block a MoE block, experts
    equally loaded). counts: collectives per step for lesson 10's transformer with `blocks` blocks (dp: FSDP2's, per
    micro-batch as dp_traffic counts them). bubble: (pp - 1) / (microbatches + pp - 1). attention saved: bytes one
    rank keeps for backward per attention layer and micro-batch (attention_saved_bytes). cp = ep = 1 gives lesson 11's
    planner.
    """
    from helpers.lessons.model_parallel import bubble_fraction

    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, not {stage!r}")
    if min(dp, tp, pp, microbatches, cp, ep) < 1:
        raise ValueError("dp, tp, pp, microbatches, cp and ep must be at least 1")
    if not 0 <= expert_params <= n_params:
        raise ValueError(f"expert_params must be between 0 and n_params, got {expert_params:g}")
    if (dp * cp) % ep:
        raise ValueError(f"ep must divide dp x cp = {dp * cp}: expert parallel ranks are carved from the ranks that "
                         f"hold the same dense weights, got ep = {ep}")
    kv_heads = heads if kv_heads is None else kv_heads
    if not 1 <= kv_heads <= heads or heads % kv_heads:
        raise ValueError(f"kv_heads must divide heads = {heads}, got {kv_heads}")
    dense = (n_params - expert_params) / (tp * pp)
    experts = expert_params / (tp * pp * ep)
    group, expert_group = dp * cp, dp * cp // ep  # the ranks that hold the same dense weights, the same experts
    per_param = {"fp16 weights": 2, "fp16 gradients": 2, "fp32 master weights": 4, "Adam state": 8,
                 "fp32 gradients": 4 if fp32_gradients else 0}
    memory = {part: dense * size / (group if part in SHARDED_PARTS[stage] else 1)
              + experts * size / (expert_group if part in SHARDED_PARTS[stage] else 1)
              for part, size in per_param.items()}
    ring = lambda n: (n - 1) / n  # noqa: E731 - the share of the data each rank sends in a ring
    activation = tokens / cp * hidden * 2  # one micro-batch's activations on this rank in bf16, bytes
    per_block = blocks / pp * microbatches
    kv_hidden = hidden * kv_heads // heads // tp
    sync = (stage, microbatches, reduce_bytes, regather, reduce_every_microbatch)
    traffic = {"dp": dp_traffic(dense, group, *sync) + dp_traffic(experts, expert_group, *sync),
               "tp": 8 * per_block * ring(tp) * activation if tp > 1 else 0.0,
               "pp": 2 * microbatches * activation if pp > 1 else 0.0,
               "cp": per_block * ring_attention_bytes(tokens, kv_hidden, cp),
               "ep": 4 * per_block * moe_all_to_all_bytes(tokens / cp, hidden, ep, top_k) if ep > 1 else 0.0}
    fsdp = fsdp_collectives(blocks)
    gathers = microbatches * (fsdp["all_gather"] if regather else blocks + 1)
    scatters = (microbatches if reduce_every_microbatch else 1) * fsdp["reduce_scatter"]
    counts = {"dp": {"all_gather": gathers, "reduce_scatter": scatters} if stage == "ZeRO-3" and group > 1 else {},
              "tp": tp_collectives(blocks) if tp > 1 else {}}
    return {"memory": memory, "traffic": traffic, "counts": counts, "bubble": bubble_fraction(pp, microbatches),
            "attention saved": attention_saved_bytes(tokens, hidden // tp, heads // tp, cp, kv_hidden=kv_hidden)}


def planner_figure(billions: float = 7.5, dp: int = 64, tp: int = 1, pp: int = 1, microbatches: int = 8,
                   stage: str = "ZeRO-3", fp32_gradients: bool = False, reduce_bytes: int = 2,
                   reduce_every_microbatch: bool = True) -> Any:
    """Three panels from `plan`: GB per rank by ZeRO stage (activations not counted), GB sent per rank and step by
    dimension (gradients reduced after every micro-batch, or with reduce_every_microbatch=False once per step, as
    DDP's no_sync and FSDP2's set_requires_gradient_sync(False) do), and the bubble."""
    import matplotlib.pyplot as plt

    _, (left, middle, right) = plt.subplots(1, 3, figsize=(12, 3.4), dpi=80, layout="constrained")
    bottoms = [0.0] * len(STAGES)
    for part in (*PARTS, "fp32 gradients"):
        values = [plan(billions * 1e9, dp, tp, pp, microbatches, s, fp32_gradients)["memory"][part] / GB
                  for s in STAGES]
        left.bar(STAGES, values, bottom=bottoms, label=part)
        bottoms = [b + v for b, v in zip(bottoms, values, strict=True)]
    for x, height in enumerate(bottoms):
        left.text(x, height, f"{height:.3g}", ha="center", va="bottom", fontsize="small")
    left.set(ylabel="GB per rank (no activations)", title=f"{billions:g}B params, dp={dp} tp={tp} pp={pp}",
             ylim=(0, 1.15 * max(bottoms)))
    left.legend(fontsize="x-small")
    chosen = plan(billions * 1e9, dp, tp, pp, microbatches, stage, fp32_gradients, reduce_bytes=reduce_bytes,
                  reduce_every_microbatch=reduce_every_microbatch)
    shown = {dim: v for dim, v in chosen["traffic"].items() if dim in ("dp", "tp", "pp") or v}  # cp, ep when used
    sent = [v / GB for v in shown.values()]
    middle.bar(list(shown), sent, color="tab:gray")  # grey: not one of the memory panel's parts
    for x, value in enumerate(sent):
        middle.text(x, value, f"{value:.3g}", ha="center", va="bottom", fontsize="small")
    # plan's fixed shape (lesson 10's 2 blocks, 4096 tokens x 4096 hidden per micro-batch) whatever the model size:
    # tp traffic grows with blocks, so it is printed on the panel rather than implied by the parameter count.
    middle.set(xlabel="mesh dimension", ylabel="GB sent per rank per step",
               title=f"{stage}: traffic by mesh dimension\n(tp, pp at a fixed 2 blocks, 4096 x 4096 activations)",
               ylim=(0, 1.15 * max(max(sent), 1e-9)))
    m = list(range(1, 65))
    for stages in sorted({2, 4, 8} - {pp}):
        right.plot(m, [plan(1, 1, 1, stages, k)["bubble"] for k in m], "-", color="lightgrey")
        right.text(64, plan(1, 1, 1, stages, 64)["bubble"], f"pp={stages}", fontsize="x-small", va="bottom", ha="right")
    right.plot(m, [plan(1, 1, 1, pp, k)["bubble"] for k in m], "-", color="tab:blue", label=f"pp={pp}")
    right.plot([microbatches], [chosen["bubble"]], "k*", markersize=12)
    right.set(xlabel="micro-batches", ylabel="idle share (1F1B)", ylim=(0, 1),
              title=f"pipeline bubble, pp={pp}, m={microbatches}: {chosen['bubble']:.1%}")
    right.legend(fontsize="x-small")
    return left


def planner_explorer() -> Any:
    """Sliders over `planner_figure` (model size, dp, tp, pp, micro-batches, stage, fp32 gradients, reduce dtype,
    and whether the gradients are reduced after every micro-batch or once per step)."""
    import ipywidgets as widgets
    import matplotlib.pyplot as plt

    wide = {"description_width": "initial"}
    controls = dict(
        billions=widgets.SelectionSlider(options=[0.125, 0.35, 1, 3, 7.5, 13, 34, 70, 175, 405, 1000], value=7.5,
                                         description="params (B)"),
        dp=widgets.IntSlider(value=64, min=1, max=512, description="dp"),
        tp=widgets.IntSlider(value=1, min=1, max=8, description="tp"),
        pp=widgets.IntSlider(value=1, min=1, max=16, description="pp"),
        microbatches=widgets.IntSlider(value=8, min=1, max=64, description="micro-batches", style=wide),
        stage=widgets.Dropdown(options=list(STAGES), value="ZeRO-3", description="stage"),
        fp32_gradients=widgets.Checkbox(value=False, description="fp32 gradients"),
        reduce_bytes=widgets.Dropdown(options=[("bf16", 2), ("fp32", 4)], value=2, description="reduce in", style=wide),
        reduce_every_microbatch=widgets.Dropdown(
            options=[("every micro-batch", True), ("last micro-batch only", False)], value=True,
            description="gradient sync", style=wide))

    def show(**values: Any) -> None:
        planner_figure(**values)
        plt.show()

    rows = [widgets.HBox(list(controls.values())[i:i + 4]) for i in range(0, len(controls), 4)]
    return widgets.VBox([*rows, widgets.interactive_output(show, controls)])


def fsdp_twin_error(world_size: int = 2) -> str:
    """Run lesson 10's FSDP layout (transformer.apply_fsdp) under LocalTensorMode; return torch's error, or ""."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    from helpers.kit.transformer import Transformer, apply_fsdp, batch, make_optimizer, train_step

    inputs, targets = batch(0, world_size)
    with simulated_world(world_size), LocalTensorMode(world_size):
        model = apply_fsdp(Transformer(seed=0), init_device_mesh("cpu", (world_size,)))
        try:
            train_step(model, make_optimizer(model), inputs, targets)
        except RuntimeError as error:
            return f"{type(error).__name__}: {error}"
    return ""


def wrapper_twin_errors(world_size: int = 2) -> dict[str, str]:
    """torch's data-parallel wrappers built under LocalTensorMode: the first line of each one's error, or ""."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    builders = {"DistributedDataParallel": lambda model: DistributedDataParallel(model),
                "ZeroRedundancyOptimizer": lambda model: ZeroRedundancyOptimizer(
                    model.parameters(), optimizer_class=torch.optim.Adam, lr=1e-3)}
    errors = {}
    for name, build in builders.items():
        with simulated_world(world_size), LocalTensorMode(world_size):
            try:
                build(nn.Linear(4, 2))
                errors[name] = ""
            except (RuntimeError, AttributeError) as error:
                errors[name] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
    errors["fully_shard"] = fsdp_twin_error(world_size)
    return errors


def first_differing_output(twin: list[dict[str, Any]], real_results: dict[int, dict[str, Any]],
                           rank: int = 0) -> tuple[list[str], str | None, float]:
    """Module outputs of the first forward, in the order they were produced: (names equal before the first that
    differs, that first name or None, its largest absolute difference)."""
    equal = []
    for name, values in twin[0]["outputs"].items():
        simulated, measured = values[rank], torch.tensor(real_results[rank]["outputs"][name])
        if simulated.shape != measured.shape or not torch.equal(simulated, measured):
            largest = float((simulated - measured).abs().max()) if simulated.shape == measured.shape else math.inf
            return equal, name, largest
        equal.append(name)
    return equal, None, 0.0


# --- time: this machine's 2-rank step, predicted from measured rates and checked against a real run ------------

MODES = ("local", "ddp", "fsdp", "fsdp_alone")
OPTIMIZER_OF = {"local": "adam local", "ddp": "adam local", "fsdp": "adam fsdp", "fsdp_alone": "adam fsdp_alone"}
# Each increment: (the setting, its control, what the difference holds)
INCREMENTS = {"ddp": ("ddp", "local", "DDP over local: its all-reduces and the work around them"),
              "fsdp_alone": ("fsdp_alone", "local", "FSDP2 alone over local: FSDP2's own work, no peer"),
              "fsdp": ("fsdp", "fsdp_alone", "FSDP2 over FSDP2 alone: what a peer adds, and half the optimizer's "
                                             "work taken away")}


def predict_step_seconds(mode: str, *, n_params: int, tensors: int, batch: int, flop_rate: float,
                         optimizer_seconds: dict[str, float], latency: float, bandwidth: float,
                         bucket_bytes: list[int]) -> dict[str, float]:
    """Our prediction of one training step on 2 ranks, in parts: compute, optimizer, communication (seconds).

    compute: 6 x parameters x rows / FLOP rate (forward 2, backward 4 FLOPs per parameter and row, a multiply-add
    being 2 FLOPs, for a stack of Linear layers), from one measured matmul. optimizer: the set-up's own Adam step,
    measured alone (optimizer_seconds["adam local"] for local and DDP, "adam fsdp" and "adam fsdp_alone" for the
    two FSDP2 set-ups: DTensors, half of each tensor's rows or all of them). communication, from lesson 01's 2-rank
    fit t = latency + bytes / bandwidth, with no overlap: DDP all-reduces each of its buckets; FSDP2 all-gathers every
    layer twice and reduce-scatters it once, each rank sending half (latency / 2 + bytes / (2 bandwidth)); local and
    fsdp_alone have no peer. Nothing here stands for FSDP2's copies into and out of its buffers or its hooks.
    """
    if mode not in OPTIMIZER_OF:
        raise ValueError(f"mode must be one of {list(OPTIMIZER_OF)}, not {mode!r}")
    all_reduce = sum(latency + size / bandwidth for size in bucket_bytes)
    communication = {"local": 0.0, "fsdp_alone": 0.0, "ddp": all_reduce,
                     "fsdp": 3 * (tensors / 2 * latency / 2 + 4 * n_params / (2 * bandwidth))}
    return {"compute": 6 * n_params * batch / flop_rate, "optimizer": optimizer_seconds[OPTIMIZER_OF[mode]],
            "communication": communication[mode]}


def _paired(first: Any, second: Any) -> dict[str, float]:
    """first - second round by round (the two took turns in each round): median, lowest and highest, and every
    round's, seconds."""
    import statistics

    differences = [a - b for a, b in zip(first.wall, second.wall, strict=True)]
    return {"median": statistics.median(differences), "low": min(differences), "high": max(differences),
            "rounds": differences}


def step_figure(analysis: dict[str, Any]) -> Any:
    """Every round of every step setting (the slowest rank's wall time), its median, and what the model predicted
    for it (compute and Adam, plus communication where the fit may predict)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.8))
    for y, (mode, step) in enumerate(analysis["steps"].items()):
        ax.scatter([t * 1e3 for t in step.wall], [y] * len(step.wall), color="tab:blue", alpha=0.6,
                   label="a round" if y == 0 else None)
        ax.plot([step.median() * 1e3] * 2, [y - 0.3, y + 0.3], color="black", label="median" if y == 0 else None)
        parts = analysis["predicted"][mode]
        predicted = parts["compute"] + parts["optimizer"] + (parts["communication"] if analysis["fit_used"] else 0)
        ax.scatter([predicted * 1e3], [y], marker="x", s=80, color="tab:red",
                   label="predicted" if y == 0 else None)
    ax.set_yticks(range(len(analysis["steps"])), list(analysis["steps"]))
    ax.invert_yaxis()
    ax.set(xlabel="ms per step (slowest rank)", xlim=(0, None),
           title=f"this machine's 2-rank step, {analysis['rounds']} rounds each, taking turns")
    ax.legend(fontsize="x-small", loc="lower right")
    fig.tight_layout()
    return fig


def step_time_analysis(per_rank: dict[int, dict[str, Any]], tolerance: float = 0.25) -> dict[str, Any]:
    """What scale_step_time.py measured, merged over the ranks (a round lasts as long as its slowest rank; CPU time
    adds up over them), and our prediction beside it: the latency-bandwidth fit and its residuals (measured / fitted
    per size; the fit is used to predict only when every residual lies within 1 +- tolerance); the rates with their
    rounds (the matmul and each set-up's optimizer step, wall and CPU); the predicted parts of each mode; local's
    measured / predicted ratio in wall time and in CPU time (the same prediction made from the rates' CPU times); the
    measured steps and the timing protocol's verdicts (wall, and CPU); and the increments, measured round by round
    and predicted (predicted setting - predicted control), for each of INCREMENTS."""
    from helpers.kit.timing import across_ranks, fits_within, residual_ratios, verdict
    from helpers.lessons.collectives import fit_latency_bandwidth
    from helpers.lessons.explorers import ddp_buckets

    first = per_rank[0]
    timings = across_ranks(per_rank[rank]["timings"] for rank in sorted(per_rank))
    sizes = first["sizes"]
    sweep = [timings[f"all_reduce {size}"].median() for size in sizes]
    latency, bandwidth = fit_latency_bandwidth(sizes, sweep)
    ratios = residual_ratios(sweep, [latency + size / bandwidth for size in sizes])
    with torch.device("meta"):  # the worker's layer shapes, for DDP's own bucketing code
        layers = nn.Sequential(*[nn.Linear(first["width"], first["width"]) for _ in range(first["layers"])])
        buckets = ddp_buckets(layers, None)["rebuilt"]
    rates = {name: timings[name] for name in ("matmul", *sorted(set(OPTIMIZER_OF.values())))}

    def predicted(kind: str) -> dict[str, dict[str, float]]:
        flop_rate = 2 * first["batch"] * first["width"] ** 2 / rates["matmul"].median(kind)
        shared = dict(n_params=first["n_params"], tensors=first["tensors"], batch=first["batch"], flop_rate=flop_rate,
                      optimizer_seconds={name: rates[name].median(kind) for name in rates if name != "matmul"},
                      latency=latency, bandwidth=bandwidth, bucket_bytes=buckets)
        return {mode: predict_step_seconds(mode, **shared) for mode in MODES}

    wall, cpu = predicted("wall"), predicted("cpu")
    steps = {mode: timings[f"step {mode}"] for mode in MODES}
    local = {"wall": steps["local"].median() / (wall["local"]["compute"] + wall["local"]["optimizer"]),
             "cpu": steps["local"].median("cpu") / (cpu["local"]["compute"] + cpu["local"]["optimizer"])}
    total = {mode: sum(parts.values()) for mode, parts in wall.items()}
    return {"latency": latency, "bandwidth": bandwidth, "sizes": sizes, "sweep": sweep, "ratios": ratios,
            "fit_used": fits_within(ratios, tolerance), "tolerance": tolerance, "rates": rates,
            "flop_rate": 2 * first["batch"] * first["width"] ** 2 / rates["matmul"].median(), "buckets": buckets,
            "steps": steps, "rounds": len(steps["local"].wall), "predicted": wall, "local_ratio": local,
            "optimizer_verdicts": {kind: verdict(rates["adam fsdp_alone"], rates["adam local"], kind)
                                   for kind in ("wall", "cpu")},
            "verdicts": {name: verdict(steps[a], steps[b]) for name, (a, b, _) in INCREMENTS.items()},
            "cpu_verdicts": {name: verdict(steps[a], steps[b], "cpu") for name, (a, b, _) in INCREMENTS.items()},
            "increments": {name: _paired(steps[a], steps[b]) for name, (a, b, _) in INCREMENTS.items()},
            "predicted_increments": {name: total[a] - total[b] for name, (a, b, _) in INCREMENTS.items()}}


def increment_report(analysis: dict[str, Any]) -> list[str]:
    """The lines section 6 prints for each increment: the protocol's verdicts (wall, CPU), the increment round by
    round, and what the model predicted for it, judged only where the fit may predict: outside every round's increment
    when all the paired rounds lie on one side of it (whatever the unpaired verdict), otherwise inside the range, or
    not testable when the verdict cannot tell the two settings apart."""
    from helpers.kit.timing import outside_every_round

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.1f} ms"

    lines = []
    for name, (_, _, what) in INCREMENTS.items():
        inc, predicted = analysis["increments"][name], analysis["predicted_increments"][name]
        needs_fit = analysis["predicted"][INCREMENTS[name][0]]["communication"] > 0
        outside = outside_every_round(inc["rounds"], predicted)
        if needs_fit and not analysis["fit_used"]:
            said = f"the model's {ms(predicted)} is not a prediction here (the fit's residuals are too large)"
        elif outside:
            said = f"the model predicts {ms(predicted)}, outside every round's increment: {outside}"
        elif not analysis["verdicts"][name].distinguishable:
            said = (f"the model predicts {ms(predicted)}, inside the rounds' range, which this run cannot test: it "
                    "cannot tell the two apart")
        else:
            said = f"the model predicts {ms(predicted)}, inside the measured range"
        if name == "fsdp_alone":  # no peer, so no communication: the optimizer over DTensors is the model's only term
            said += "; of FSDP2's own work the model has a term for the optimizer only, none for copies and hooks"
        lines += [f"{what}:", f"  VERDICT {analysis['verdicts'][name].sentence}",
                  f"  per round {ms(inc['median'])} (from {ms(inc['low'])} to {ms(inc['high'])}); {said}",
                  f"  CPU: {analysis['cpu_verdicts'][name].sentence}"]
    return lines
