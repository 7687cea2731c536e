"""Lesson 10 (meshes): the collective plan of each layout, the exercise's check, and what the notebook measures.

    from helpers.lessons.mesh import expected_counts, measured_counts, check_mlp_plan, load_in_one_process
    from helpers.lessons.mesh import checkpoint_chunks, not_sharded_by_rows  # what a DCP checkpoint's .metadata says
    expected_counts("fsdp_tp")      # {"forward": {"tp/all_gather": 6, ...}, "backward": {...}}

The workers are helpers/workers/mesh_*.py; the model and the layouts are helpers/kit/transformer.py.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from helpers.kit import WORKERS
from helpers.lessons.checks import correct, not_yet, not_yet_crashed

# torch's op names for each collective: FSDP2 calls c10d (dist.all_gather_into_tensor and friends),
# DTensor calls the functional collectives (torch.distributed._functional_collectives).
KIND = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
        "allreduce_": "all_reduce", "all_reduce": "all_reduce"}


def expected_counts(layout: str, blocks: int = 2) -> dict[str, Counter]:
    """The plan: collectives per training step, by phase, as "dimension/collective" -> count.

    FSDP2 (fully_shard on each block, then on the root): one unit per block plus the root. Each unit is
    all-gathered before its forward and its gradients reduce-scattered after its backward. Before its
    backward a unit is all-gathered again only if it was resharded after forward: reshard_after_forward=None
    (the default) means True for every unit but the root, which stays gathered (torch 2.14,
    fsdp/_fully_shard/_fully_shard.py, the docstring of reshard_after_forward; _fsdp_state.py, _lazy_init).
    HSDP adds one all-reduce per unit across the replicas (the replicate dimension).
    TP without sequence parallelism (torchtitan's plan less the SequenceParallel parts): forward, one all-reduce
    after each row-wise layer (wo, w2) and after the row-wise embedding, one all-gather of the column-wise
    output layer's logits. Backward, an all-reduce of the input gradient of each column-wise layer: wq, wk and
    wv each turn the same input into a DTensor of their own, so the attention's input gradient is all-reduced
    three times, w1's once, the output layer's once.
    TP with sequence parallelism: each all-reduce becomes a reduce-scatter (to Shard(1) on the sequence) and the
    next layer's input an all-gather; backward mirrors forward, and the RMSNorm weights, replicated over tp,
    have their gradients all-reduced (one per norm: 2 per block and the final one).
    """
    units = blocks + 1
    fsdp_dim = {"fsdp": "dp", "hsdp": "shard", "fsdp_tp": "dp", "fsdp_tp_no_sp": "dp"}[layout]
    forward = Counter({f"{fsdp_dim}/all_gather": units})
    backward = Counter({f"{fsdp_dim}/all_gather": units - 1, f"{fsdp_dim}/reduce_scatter": units})
    if layout == "hsdp":
        backward["replicate/all_reduce"] = units
    if layout == "fsdp_tp_no_sp":
        forward.update({"tp/all_reduce": 2 * blocks + 1, "tp/all_gather": 1})
        backward.update({"tp/all_reduce": 4 * blocks + 1})
    if layout == "fsdp_tp":
        forward.update({"tp/all_gather": 2 * blocks + 2, "tp/reduce_scatter": 2 * blocks + 1})
        backward.update({"tp/all_gather": 2 * blocks + 1, "tp/reduce_scatter": 2 * blocks + 1,
                         "tp/all_reduce": 2 * blocks + 1})
    return {"forward": forward, "backward": backward}


def measured_counts(counts: dict, what: str = "calls") -> dict[str, Counter]:
    """The worker's counts ("op/dimension" -> n) as "dimension/collective" -> n, per phase."""
    out = {}
    for phase in ("forward", "backward", "optimizer"):
        out[phase] = Counter()
        for key, value in counts[phase][what].items():
            op, dimension = key.split("/")
            out[phase][f"{dimension}/{KIND[op]}"] += value
    return out


def agrees_with_commdebugmode(counts: dict) -> bool:
    """Does our per-dimension count add up, op by op, to CommDebugMode's count, in every phase?"""
    for phase in ("forward", "backward", "optimizer"):
        ours = Counter()
        for key, value in counts[phase]["calls"].items():
            ours[key.split("/")[0]] += value
        if ours != Counter(counts[phase]["commdebugmode"]):
            return False
    return True


def checkpoint_files(folder: str | os.PathLike) -> list[tuple[str, int]]:
    """(file name, bytes) of a DCP checkpoint folder, sorted by name."""
    return sorted((entry.name, entry.stat().st_size) for entry in os.scandir(folder) if entry.is_file())


def checkpoint_chunks(folder: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """What a DCP checkpoint's .metadata says it holds: for each tensor with at least one dimension, its whole
    size and its chunks, each with its offsets, sizes and the file it lies in (FileSystemReader.read_metadata:
    state_dict_metadata gives the chunks, storage_data maps each chunk to a file)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = FileSystemReader(os.fspath(folder)).read_metadata()
    files = {(index.fqn, tuple(index.offset or ())): info.relative_path
             for index, info in metadata.storage_data.items()}
    return {name: {"size": list(entry.size),
                   "chunks": sorted(({"offsets": list(chunk.offsets), "sizes": list(chunk.sizes),
                                      "file": files[(name, tuple(chunk.offsets))]} for chunk in entry.chunks),
                                    key=lambda chunk: chunk["offsets"])}
            for name, entry in metadata.state_dict_metadata.items()
            if isinstance(entry, TensorStorageMetadata) and len(entry.size) > 0}


def not_sharded_by_rows(chunks: dict[str, dict[str, Any]], ranks: int) -> list[str]:
    """The tensors whose chunks are not `ranks` distinct row ranges of equal height, the one starting at row
    r * rows / ranks in rank r's file (__r_0.distcp), each spanning every other dimension whole. A replicated
    save (whole tensors, one chunk each) fails this, whichever files DCP spread the whole tensors over."""
    wrong = []
    for name, entry in chunks.items():
        rows, rest = entry["size"][0], entry["size"][1:]
        expected = [{"offsets": [rank * rows // ranks] + [0] * len(rest), "sizes": [rows // ranks, *rest],
                     "file": f"__{rank}_0.distcp"} for rank in range(ranks)]
        if rows % ranks or entry["chunks"] != expected:
            wrong.append(name)
    return wrong


def load_in_one_process(folder: str | os.PathLike, truth_file: str | os.PathLike) -> dict[str, Any]:
    """Load a DCP checkpoint into the plain (unsharded) model in this process, with no process group
    (dcp.load(no_dist=True)); compare every value with the saved truth, bit for bit."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from helpers.kit import transformer

    model = transformer.Transformer(seed=1)  # other weights than the checkpoint's, so that the load must work
    optimizer = transformer.make_optimizer(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state, "step": -1}
    with warnings.catch_warnings():  # dcp.load warns whenever no_dist holds, even when asked for (state_dict_loader.py)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=folder, no_dist=True)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    model_state, optim_state = get_state_dict(model, optimizer)
    loaded = {f"model.{name}": value for name, value in model_state.items()}
    for name, moments in optim_state["state"].items():
        loaded.update({f"optim.{name}.{key}": value for key, value in moments.items()})
    truth = torch.load(truth_file)
    unequal = sorted(key for key in truth if key not in loaded or not torch.equal(truth[key], loaded[key]))
    return {"step": state["step"], "compared": len(truth), "unequal": unequal,
            "initialized": torch.distributed.is_initialized()}


def measure_launch(start_run: Callable[[], Any], every: float = 0.1) -> dict[str, Any]:
    """Run `start_run()` while sampling this process's descendants (launch server, agents, workers): their
    largest summed PSS, the number of distinct descendant processes, and the wall time.
    Linux (PSS from /proc). Only descendants are sampled: this process's own memory is not counted.
    Processes are counted by pid over the whole run, not as the most alive in one sample, and the count
    adds what the run folders recorded (each worker's pid and its agent's): reading PSS of a torch process
    is slow next to a worker's life on a busy machine, so sampling alone can miss a worker (it did in CI,
    counting a two-agent launch as no more processes than a one-agent one)."""
    import psutil

    peak = {"pss": 0}
    seen: set[int] = set()
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            total, children = 0, psutil.Process().children(recursive=True)
            seen.update(process.pid for process in children)
            for process in children:
                try:
                    total += process.memory_full_info().pss
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            peak["pss"] = max(peak["pss"], total)
            stop.wait(every)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started = time.perf_counter()
    try:
        value = start_run()
    finally:
        stop.set()
        sampler.join()
    seconds = time.perf_counter() - started
    for run in value if isinstance(value, (list, tuple)) else [value]:
        if getattr(run, "log_dir", None) is not None:
            seen |= run.processes()
    return {"value": value, "seconds": seconds, "processes": len(seen), **peak}


# ---------------------------------------------------------------------------- the exercise

def judge_plan(results: dict[int, dict]) -> bool:
    """The exercise's verdict from mesh_plan_check.py's results (rank -> report); prints why."""
    report = results[0]
    if "error" in report:
        hint = ""
        if "Sharding propagation failed" in report["error"] or "shapes cannot be multiplied" in report["error"]:
            hint = (" Each style says what input its layer expects: ColwiseParallel the whole input (Replicate),"
                    " RowwiseParallel an input split along its features, as a column-wise layer leaves it.")
        return not_yet(f"torch refused the plan on 2 ranks: {report['error']}.{hint}")
    for name, expected in (("w1", "Shard(dim=0)"), ("w2", "Shard(dim=1)")):
        placements = report["weights"][name]["placements"]
        if placements != [expected]:
            return not_yet(f"{name}'s weight is {placements or 'a plain tensor, whole on every rank'}: the pair "
                           f"saves memory only if each rank holds half of each weight ({name} as {expected}).")
    if report["output_shape"] != report["expected_shape"]:
        return not_yet(f"the block's output on each rank has shape {report['output_shape']}, one process's "
                       f"{report['expected_shape']}: every rank should end with the whole output (Replicate).")
    if report["output_diff"] > 1e-5 or report["grad_diff"] > 1e-5:
        return not_yet(f"the output (max diff {report['output_diff']:.1e}) or the gradients of the weights and of "
                       f"the input (max diff {report['grad_diff']:.1e}) differ from one process's.")
    forward, backward = report["collectives"]["forward"], report["collectives"]["backward"]
    if forward != {"all_reduce": 1} or backward != {"all_reduce": 1}:
        return not_yet(f"right answer, but forward ran {forward or 'no collectives'} and backward "
                       f"{backward or 'none'}: column-wise then row-wise needs one all-reduce in forward (summing "
                       "w2's output terms) and one in backward (summing the input's gradient terms from w1's halves); "
                       "keep w1's output sharded, as w2 wants it.")
    return correct("w1 is split by its output features (Shard(0)), w2 by its input features (Shard(1)); "
                   "forward runs one all-reduce (summing w2's output terms) and backward one (summing the "
                   "input's gradient terms that w1's halves produce), and the output and the gradients of the "
                   "weights and of the input match one process's within 1e-5.")


def check_mlp_plan(plan_file: str | os.PathLike, timeout: float = 60) -> bool:
    """The exercise: launch the MLP block with the plan in `plan_file` (it defines PLAN) on 2 ranks."""
    from helpers import LaunchTimeout, WorkerFailed, launch

    source = Path(plan_file).read_text()
    if "PLAN" not in source:
        return not_yet(f"{Path(plan_file).name} must define PLAN, the dict parallelize_module takes.")
    try:
        run = launch(WORKERS / "mesh_plan_check.py", nproc=2, args=[str(Path(plan_file).resolve())],
                     echo=False, timeout=timeout)
    except LaunchTimeout:
        return not_yet(f"the check was still running after {timeout:g} s.")
    except WorkerFailed as error:
        return not_yet_crashed(error, f"the check of {Path(plan_file).name}")
    return judge_plan(run.results)


# ---------------------------------------------------------------------------- the second exercise

_GROUPS_OF_EVERY_RANK = """
import json, math, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
shape, names = json.loads(sys.argv[1])
world_size, groups = math.prod(shape), {}
for rank in range(world_size):  # the fake backend lets one process play each rank in turn, with no peers
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
    groups[rank] = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in names}
    dist.destroy_process_group()
print(json.dumps(groups))
"""


def mesh_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[int, dict[str, list[int]]]:
    """Every rank's group along each mesh dimension, as torch's init_device_mesh builds them: run in a child
    process with torch's fake backend (one process plays each rank in turn; no collective runs).
    The child imports torch afresh, so this kernel's launch server is stopped first (stop_launch_server):
    beside the kernel and the server, a third copy of torch's memory took lesson 10 over its 1.5 GiB budget."""
    import json
    import subprocess
    import sys

    from helpers.launcher.api import stop_launch_server

    stop_launch_server(before="the child interpreter")
    done = subprocess.run([sys.executable, "-c", _GROUPS_OF_EVERY_RANK, json.dumps([list(shape), list(names)])],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1])
    return {int(rank): groups for rank, groups in json.loads(done.stdout).items()}


def check_mesh_for(mesh_for: Callable[[int, int], Any],
                   clusters: tuple[tuple[int, int], ...] = ((2, 4), (4, 2), (3, 8))) -> bool:
    """The second exercise: mesh_for(nodes, gpus_per_node) -> (mesh_shape, mesh_dim_names) must put "tp" on
    the GPUs of one node and "dp" across nodes, with torchrun's numbering (rank = node * gpus_per_node + local)."""
    import math

    for nodes, gpus in clusters:
        answer = mesh_for(nodes, gpus)
        if not (isinstance(answer, tuple) and len(answer) == 2):
            return not_yet(f"mesh_for({nodes}, {gpus}) returned {answer!r}, not (mesh_shape, mesh_dim_names).")
        shape, names = tuple(answer[0]), tuple(answer[1])
        if sorted(names) != ["dp", "tp"] or len(shape) != 2:
            return not_yet(f"mesh_for({nodes}, {gpus}) named the dimensions {names} for shape {shape}: "
                           "give two dimensions, named 'dp' and 'tp'.")
        if math.prod(shape) != nodes * gpus:
            return not_yet(f"a {shape} mesh has {math.prod(shape)} ranks; {nodes} nodes x {gpus} GPUs have "
                           f"{nodes * gpus}.")
        groups = mesh_groups(shape, names)
        for rank, mine in sorted(groups.items()):
            spanned = sorted({member // gpus for member in mine["tp"]})
            if len(spanned) > 1:
                return not_yet(f"on {nodes} nodes x {gpus} GPUs, rank {rank}'s tp group is {mine['tp']}: it spans "
                               f"nodes {spanned}, so every layer's collectives would cross the network.")
            if len(mine["tp"]) != gpus:
                return not_yet(f"on {nodes} nodes x {gpus} GPUs, rank {rank}'s tp group is {mine['tp']}: "
                               f"{len(mine['tp'])} of the node's {gpus} GPUs; use the whole node for tp.")
            if sorted(member // gpus for member in mine["dp"]) != list(range(nodes)):
                return not_yet(f"on {nodes} nodes x {gpus} GPUs, rank {rank}'s dp group is {mine['dp']}: it should "
                               "hold one GPU from each node.")
    return correct(f"on each of {len(clusters)} clusters, torch's init_device_mesh gives every rank a tp group "
                   "that is exactly its own node and a dp group with one GPU from each node.")
