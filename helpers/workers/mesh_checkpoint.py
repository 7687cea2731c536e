"""DCP checkpoints that reshard: save under one layout, load under another, check every value, resume.

    torchrun --standalone --nproc-per-node 4 helpers/workers/mesh_checkpoint.py save --dir runs/mesh-checkpoint
    torchrun --standalone --nproc-per-node 4 helpers/workers/mesh_checkpoint.py load --layout fsdp_tp \
        --dir runs/mesh-checkpoint
    torchrun --standalone --nproc-per-node 2 helpers/workers/mesh_checkpoint.py load --layout fsdp \
        --dir runs/mesh-checkpoint

save: FSDP2 over every rank trains --save-at steps, then hands model and optimizer state (get_state_dict)
to dcp.async_save and goes straight on with the next step, noting when async_save returned, when the step
ran, when torch's FileSystemWriter.write_data wrote the files (timed by wrapping it) and when torch's future said
the write was done; then it trains on to --steps (the uninterrupted run).
Rank 0 also writes full_state.pt: every value gathered with full_tensor() just before the save, the truth
the loads are compared with. load: builds the model under --layout (fsdp over all ranks, or fsdp_tp on a
(dp, tp) mesh), loads the checkpoint with dcp.load and set_state_dict, compares every parameter's and
optimizer value's full_tensor() with full_state.pt bit for bit, and resumes training from the saved step.
"""
import argparse
import logging
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from helpers.kit import transformer
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, report, result

warnings.filterwarnings("ignore", message="FSDP2-wrapped module")  # the root returns a view; we never write into it
# full_tensor() of a _StridedShard value (fsdp_tp) logs "2 sequential all_gather operations": time, not correctness.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def build(layout: str, world_size: int, device: torch.device) -> tuple[torch.nn.Module, int, int]:
    """The model under `layout`; returns (model, this rank's data-parallel index, data-parallel size)."""
    model = transformer.Transformer(seed=0).to(device)
    if layout == "fsdp":
        transformer.apply_fsdp(model, init_device_mesh(device.type, (world_size,), mesh_dim_names=("dp",)))
        return model, dist.get_rank(), world_size
    mesh = init_device_mesh(device.type, (world_size // 2, 2), mesh_dim_names=("dp", "tp"))
    transformer.apply_fsdp_tp(model, mesh)
    return model, mesh["dp"].get_local_rank(), mesh["dp"].size()


def full_values(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every parameter and optimizer value, whole: full_tensor() all-gathers a DTensor's shards."""
    model_state, optim_state = get_state_dict(model, optimizer)
    values = {f"model.{name}": value for name, value in model_state.items()}
    for name, moments in optim_state["state"].items():
        values.update({f"optim.{name}.{key}": value for key, value in moments.items()})
    return {key: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone().cpu() for key, v in values.items()}


def train(model, optimizer, steps: range, global_batch: int, dp_index: int, dp_size: int) -> list[float]:
    losses = []
    for step in steps:
        inputs, targets = transformer.batch(step, global_batch)
        device = next(model.parameters()).device
        loss = transformer.train_step(model, optimizer, transformer.rows(inputs, dp_index, dp_size).to(device),
                                      transformer.rows(targets, dp_index, dp_size).to(device))
        dist.all_reduce(loss)  # the global batch's mean loss, as one process computes it
        losses.append(loss.item() / dist.get_world_size())  # tp ranks hold equal losses: still the mean
        report(step=step, loss=losses[-1])
        progress(step + 1, steps.stop)
    return losses


def save(args, model, optimizer, dp_index: int, dp_size: int) -> None:
    losses = train(model, optimizer, range(args.save_at), args.global_batch, dp_index, dp_size)
    truth = full_values(model, optimizer)
    if dist.get_rank() == 0:
        torch.save(truth, os.path.join(args.dir, "full_state.pt"))
    model_state, optim_state = get_state_dict(model, optimizer)
    # The write's collectives run in a background thread: give them a group of their own (gloo works on CPU).
    checkpoint_group = dist.new_group(backend="gloo")
    times = {"called": time.time()}
    # When the files are written: async_save's writer is torch's FileSystemWriter, whose write_data writes this
    # rank's items before it returns (filesystem.py, _write_data). We time it in the background thread it runs in.
    write_data = dcp.FileSystemWriter.write_data

    def timed_write_data(self, *args, **kwargs):
        times["write_start"] = time.time()
        written = write_data(self, *args, **kwargs)
        times["write_end"] = time.time()
        return written

    dcp.FileSystemWriter.write_data = timed_write_data
    future = dcp.async_save({"model": model_state, "optim": optim_state, "step": args.save_at},
                            checkpoint_id=os.path.join(args.dir, f"step-{args.save_at}"),
                            process_group=checkpoint_group)
    times["returned"] = time.time()
    future.add_done_callback(lambda _: times.__setitem__("written", time.time()))
    in_flight_at_step_start = not future.done()
    times["step_start"] = time.time()
    losses += train(model, optimizer, range(args.save_at, args.save_at + 1), args.global_batch, dp_index, dp_size)
    times["step_end"] = time.time()
    future.result()
    times["result"] = time.time()
    dcp.FileSystemWriter.write_data = write_data
    losses += train(model, optimizer, range(args.save_at + 1, args.steps), args.global_batch, dp_index, dp_size)
    result(losses=losses, times=times, in_flight_at_step_start=in_flight_at_step_start)


def load(args, model, optimizer, dp_index: int, dp_size: int) -> None:
    model_state, optim_state = get_state_dict(model, optimizer)  # also creates Adam's state, to be filled
    state = {"model": model_state, "optim": optim_state, "step": -1}
    dcp.load(state, checkpoint_id=os.path.join(args.dir, f"step-{args.save_at}"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    truth, loaded = torch.load(os.path.join(args.dir, "full_state.pt")), full_values(model, optimizer)  # both on CPU
    unequal = sorted(key for key in truth if key not in loaded or not torch.equal(truth[key], loaded[key]))
    local = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    losses = train(model, optimizer, range(state["step"], args.steps), args.global_batch, dp_index, dp_size)
    result(step=state["step"], compared=len(truth), unequal=unequal, extra=sorted(set(loaded) - set(truth)),
           local_shapes=local, losses=losses)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phase", choices=("save", "load"))
    parser.add_argument("--dir", default="runs/mesh-checkpoint")
    parser.add_argument("--layout", choices=("fsdp", "fsdp_tp"), default="fsdp")
    parser.add_argument("--save-at", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    _, world_size, device = init_distributed()
    os.makedirs(args.dir, exist_ok=True)
    model, dp_index, dp_size = build(args.layout, world_size, device)
    optimizer = transformer.make_optimizer(model)
    (save if args.phase == "save" else load)(args, model, optimizer, dp_index, dp_size)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
