"""One transformer, four layouts on four processes; every loss reported, every collective counted per mesh dimension.

    torchrun --standalone --nproc-per-node 4 helpers/workers/mesh_layouts.py --steps 20

Layouts (helpers/kit/transformer.py): fsdp (FSDP2 over a 1-D mesh of all ranks), hsdp (a 2-D mesh
("replicate", "shard") given to fully_shard), fsdp_tp (tensor + sequence parallelism over "tp", FSDP over
"dp") and fsdp_tp_no_sp (the same without sequence parallelism). Every step uses the same global batch
(the same tokens) as one process would; each data-parallel rank takes its rows. After step 0's backward every
gradient, gathered whole, is compared with one process's (a plain model in this worker). Step 1 (after FSDP's lazy
initialisation in step 0) runs under torch's CommDebugMode and under CollectivesByDimension, which also
reads each collective's process group and names its mesh dimension; forward, backward and the optimizer
step are counted apart. Each layout reports, per step, its global mean loss (all-reduced: the same on every
rank by construction) and this rank's own loss on its rows before that all-reduce, the rows it took at step 0,
the local shape of the residual stream leaving block 0, and which rows and columns of two weights it holds.
Needs 4 ranks (a 2 x 2 mesh).
"""
import argparse
import logging
import warnings
from collections import Counter

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.distributed_c10d import ProcessGroup, _resolve_process_group
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.kit import transformer
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, result

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the root returns a view; we never write into it
# full_tensor() of a _StridedShard parameter (TP split its rows, then FSDP split them again) logs "2 sequential
# all_gather operations will be performed": it costs time, not correctness (lesson 10 says why, in a fold).
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
SHOWN = ("layers.0.attention.wq.weight", "layers.0.attention.wo.weight")  # the lesson draws who holds what of them

# What each collective moves, counted as lesson 07 counts: the full (unsharded) tensor. The argument index
# is the output of an all-gather, the input of a reduce-scatter, the tensor of an all-reduce.
FULL_TENSOR_ARG = {"_allgather_base_": 0, "_reduce_scatter_base_": 1, "allreduce_": 0,
                   "all_gather_into_tensor": None, "reduce_scatter_tensor": 0, "all_reduce": 0}


class CollectivesByDimension(TorchDispatchMode):
    """Ours: count each collective op by the mesh dimension whose ranks run it, with its bytes.
    c10d ops (FSDP2's) carry the ProcessGroup as a boxed object; functional ones (DTensor's) its name.
    Matched by ranks, not by name: two meshes over the same ranks may share one group.
    Beside torch's CommDebugMode, not instead of it: CommDebugMode counts per op, with no process group
    (torch/distributed/tensor/debug/_comm_mode.py:706), so it cannot tell dp's all-gathers from tp's; the lesson
    checks that both give the same totals (helpers.lessons.mesh.agrees_with_commdebugmode)."""

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.dimension = {tuple(dist.get_process_group_ranks(mesh.get_group(name))): name
                          for name in mesh.mesh_dim_names}
        self.calls, self.bytes = Counter(), Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        op = func._overloadpacket._qualified_op_name.split("::")[-1]
        if func.namespace in ("c10d", "_c10d_functional") and op in FULL_TENSOR_ARG:
            if func.namespace == "_c10d_functional":  # the last argument is the group's name
                group = _resolve_process_group(args[-1])
            else:
                group = next(ProcessGroup.unbox(a) for a in args
                             if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type()))
            ranks = tuple(dist.get_process_group_ranks(group))
            index = FULL_TENSOR_ARG[op]
            tensor = out if index is None else args[index]
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            key = (op, self.dimension.get(ranks, f"ranks {list(ranks)}"))
            self.calls[key] += 1
            self.bytes[key] += tensor.numel() * tensor.element_size()
        return out


def build(layout: str, device: torch.device) -> tuple[torch.nn.Module, DeviceMesh, int, int]:
    """The layout's model and mesh; returns (model, mesh, data-parallel index, data-parallel size)."""
    model, rank = transformer.Transformer(seed=0).to(device), dist.get_rank()
    if layout == "fsdp":
        mesh = init_device_mesh(device.type, (4,), mesh_dim_names=("dp",))
        return transformer.apply_fsdp(model, mesh), mesh, rank, 4
    if layout == "hsdp":
        mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("replicate", "shard"))
        return transformer.apply_hsdp(model, mesh), mesh, rank, 4
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    transformer.apply_fsdp_tp(model, mesh, sequence_parallel=(layout == "fsdp_tp"))
    return model, mesh, mesh["dp"].get_local_rank(), 2


def held_rows_and_columns(parameter: DTensor) -> dict[str, list[int]]:
    """Which rows and columns of the whole weight this rank holds: each local value looked up in the whole
    (random weights: every value occurs once). A collective (full_tensor): every rank calls it in the same order."""
    whole = parameter.full_tensor()
    where = {value: divmod(index, whole.shape[1]) for index, value in enumerate(whole.flatten().tolist())}
    cells = [where[value] for value in parameter.to_local().flatten().tolist()]
    return {"rows": sorted({row for row, _ in cells}), "columns": sorted({column for _, column in cells})}


def counted_step(model, optimizer, mesh, inputs, targets) -> tuple[torch.Tensor, dict]:
    """One training step with forward, backward and optimizer step counted apart; returns (loss, counts)."""
    counts = {}
    for phase in ("forward", "backward", "optimizer"):
        with CommDebugMode() as torch_view, CollectivesByDimension(mesh) as ours:
            if phase == "forward":
                loss = transformer.loss_fn(model(inputs), targets)
            elif phase == "backward":
                loss.backward()
            else:
                optimizer.step()
                optimizer.zero_grad()
        counts[phase] = {"calls": {"/".join(k): v for k, v in sorted(ours.calls.items())},
                         "bytes": {"/".join(k): v for k, v in sorted(ours.bytes.items())},
                         "commdebugmode": {str(op).split(".")[-1]: n for op, n in torch_view.get_comm_counts().items()}}
    return loss.detach(), counts


def gradient_gap(model, inputs, targets, global_batch: int, device: torch.device) -> tuple[torch.Tensor, float, float]:
    """Step 0's forward and backward; returns (loss, largest |gradient - one process's gradient|, largest |one
    process's gradient|). The loss alone would not catch wrongly scaled gradients: AdamW's update barely depends
    on the gradient's scale. A factor f shows as a gap of about |f - 1| x the largest gradient."""
    plain = transformer.Transformer(seed=0).to(device)  # one process's model, fed the whole global batch
    all_inputs, all_targets = (t.to(device) for t in transformer.batch(0, global_batch))
    transformer.loss_fn(plain(all_inputs), all_targets).backward()
    loss = transformer.loss_fn(model(inputs), targets)
    loss.backward()
    expected = dict(plain.named_parameters())
    gap = max((p.grad.full_tensor() - expected[name].grad).abs().max().item() for name, p in model.named_parameters())
    return loss.detach(), gap, max(p.grad.abs().max().item() for p in plain.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, over all ranks")
    parser.add_argument("--layouts", nargs="+", default=["fsdp", "hsdp", "fsdp_tp", "fsdp_tp_no_sp"])
    args = parser.parse_args()
    _, world_size, device = init_distributed()
    if world_size != 4:
        raise SystemExit(f"this worker lays the model out on a 2 x 2 mesh: start it with 4 processes, "
                         f"not {world_size}")
    out = {}
    progress(0, len(args.layouts) * args.steps)
    for number, layout in enumerate(args.layouts):
        model, mesh, dp_index, dp_size = build(layout, device)
        parameters = dict(model.named_parameters())
        held = {name: held_rows_and_columns(parameters[name]) for name in SHOWN}
        optimizer = transformer.make_optimizer(model)
        losses, local_losses, counts, stream = [], [], None, {}
        # The residual stream leaving block 0, as this rank holds it: sequence parallelism halves it along the sequence.
        hook = model.layers["0"].register_forward_hook(lambda _m, _i, out, stream=stream: stream.__setitem__(
            "shape", list((out.to_local() if isinstance(out, DTensor) else out).shape)))
        for step in range(args.steps):
            inputs, targets = (transformer.rows(t, dp_index, dp_size).to(device)
                               for t in transformer.batch(step, args.global_batch))
            if step == 0:
                rows_step0 = inputs.tolist()
                loss, grad_gap, grad_max = gradient_gap(model, inputs, targets, args.global_batch, device)
                optimizer.step()
                optimizer.zero_grad()
            elif step == 1:
                loss, counts = counted_step(model, optimizer, mesh, inputs, targets)
            else:
                loss = transformer.train_step(model, optimizer, inputs, targets)
            local_losses.append(loss.item())  # this rank's rows only: ranks with other rows must differ
            dist.all_reduce(loss)  # every rank's mean, summed; tp ranks hold equal ones, so / world_size is the mean
            losses.append(loss.item() / world_size)
            progress(number * args.steps + step + 1, len(args.layouts) * args.steps)
        hook.remove()
        local = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
        placements = {name: repr(tuple(p.placements)) for name, p in model.named_parameters()}
        out[layout] = {"losses": losses, "local_losses": local_losses, "dp_index": dp_index, "rows_step0": rows_step0,
                       "stream_shape": stream["shape"], "grad_gap": grad_gap, "grad_max": grad_max, "counts": counts,
                       "local_shapes": local, "placements": placements, "held": held,
                       "groups": {name: dist.get_process_group_ranks(mesh.get_group(name))
                                  for name in mesh.mesh_dim_names}}
    result(**out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
