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
from helpers.lessons.checks import announce_run, correct, not_yet, not_yet_crashed

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

GATE_MISMATCH = ("must match the size", "mixed torch.Tensor and DTensor")
REFUSED = ("Sharding propagation failed", "shapes cannot be multiplied")


def judge_plan(report: dict[str, Any]) -> bool:
    """The exercise's verdict on one of mesh_plan_check.py's reports (rank 0's); prints why."""
    if "error" in report:
        hint = ""
        if any(words in report["error"] for words in GATE_MISMATCH):
            hint = (" silu(w1(x)) * w3(x) multiplies two layers' outputs element by element: on every rank both must"
                    " hold the same hidden features, in the same form.")
        elif any(words in report["error"] for words in REFUSED):
            hint = (" Each style expects its input in a certain form, and leaves its output in one: follow x from"
                    " layer to layer and check that what one layer leaves is what the next one takes.")
        where = f", in {report['layer']}'s forward" if report.get("layer") else ""
        return not_yet(f"torch refused the plan on 2 ranks{where}: {report['error']}.{hint}")
    whole = [name for name in ("w1", "w3", "w2") if not report["weights"][name]["placements"]]
    if whole:
        return not_yet(f"{', '.join(whole)} {'is' if len(whole) == 1 else 'are'} whole on every rank (a plain "
                       "tensor): a tensor-parallel plan saves memory only if every weight of the block is split "
                       "between the 2 ranks.")
    if report["output_shape"] != report["expected_shape"]:
        return not_yet(f"the block's output on each rank has shape {report['output_shape']}, one process's "
                       f"{report['expected_shape']}: every rank should end with the whole output.")
    if report["output_diff"] > 1e-5 or report["grad_diff"] > 1e-5:
        return not_yet(f"the output (max diff {report['output_diff']:.1e}) or the gradients of the weights and of "
                       f"the input (max diff {report['grad_diff']:.1e}) differ from one process's.")
    forward, backward = report["collectives"]["forward"], report["collectives"]["backward"]
    if forward != {"all_reduce": 1} or backward not in ({"all_reduce": 1}, {"all_reduce": 2}):
        return not_yet(f"right numbers, but forward ran {forward or 'no collectives'} and backward "
                       f"{backward or 'none'}: this split moves more than it needs. The block can be split so that "
                       "forward runs a single all-reduce; find which layers can leave their outputs split for the "
                       "next one to use as they are.")
    done = ("w1 and w3 are split by their output features (Shard(0)), so each rank computes the same half of the "
            "hidden features of both and multiplies them without talking to the other rank; w2 is split by its input "
            "features (Shard(1)) and takes that half as it is. Forward runs one all-reduce (the sum of w2's two "
            "terms), and the output and every gradient match one process's within 1e-5.")
    if backward == {"all_reduce": 2}:
        return correct(done + " Backward ran two all-reduces of the input's gradient, one per column-wise layer, "
                       "as wq, wk and wv do in section 3. One is enough: give the block itself an entry, \"\": "
                       "PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),), "
                       "use_local_output=False), and w1 and w3 share one DTensor input whose two gradient terms are "
                       "added before a single all-reduce (try it: the check counts it).")
    return correct(done + " Backward runs one all-reduce too: w1 and w3 share one DTensor input, so their gradient "
                   "terms are added before a single all-reduce.")


def check_mlp_plan(plan_file: str | os.PathLike, timeout: float = 60) -> bool:
    """The exercise: launch the gated MLP block with the plan in `plan_file` (it defines PLAN) on 2 ranks."""
    return check_mlp_plans([plan_file], timeout)[0]


def check_mlp_plans(plan_files: list[str | os.PathLike], timeout: float = 60) -> list[bool]:
    """check_mlp_plan for several plan files in one launch (each judged in turn, its message printed)."""
    from helpers import LaunchTimeout, WorkerFailed, launch

    paths = [Path(plan_file) for plan_file in plan_files]
    for path in paths:
        if not path.exists():
            return [not_yet(f"{path.name} does not exist yet: run the %%writefile cell above it first.")]
        if "PLAN" not in path.read_text():
            return [not_yet(f"{path.name} must define PLAN, the dict parallelize_module takes.")]
    names = ", ".join(path.name for path in paths)
    announce_run(f"your plan ({names}) on the gated MLP block", 2, timeout, stop_after=30)
    try:
        run = launch(WORKERS / "mesh_plan_check.py", nproc=2, args=[str(path.resolve()) for path in paths],
                     echo=False, timeout=timeout)
    except (LaunchTimeout, WorkerFailed) as error:
        return [not_yet_crashed(error, f"the check of {names}")]
    return [judge_plan(report) for report in run.results[0]["reports"]]


# ---------------------------------------------------------------------------- the second exercise

_GROUPS_OF_EVERY_RANK = """
import json, math, sys
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore
for shape, names in json.loads(sys.argv[1]):
    world_size, groups = math.prod(shape), {}
    for rank in range(world_size):  # the fake backend lets one process play each rank in turn, with no peers
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        mesh = init_device_mesh("cpu", tuple(shape), mesh_dim_names=tuple(names))
        groups[rank] = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in names}
        dist.destroy_process_group()
    print(json.dumps(groups), flush=True)
"""


def mesh_groups_of(meshes: list[tuple[tuple[int, ...], tuple[str, ...]]],
                   each: Callable[[int], None] | None = None) -> list[dict[int, dict[str, list[int]]]]:
    """For each (shape, names), every rank's group along each mesh dimension, as torch's init_device_mesh builds
    them: one child process with torch's fake backend plays each rank in turn (no collective runs).
    `each(i)` is called as soon as mesh i is done. The child imports torch afresh, so this kernel's launch server
    is stopped first: beside the kernel and the server, a third copy of torch took lesson 10 over 1.5 GiB."""
    import json
    import subprocess
    import sys

    from helpers.launcher.api import stop_launch_server

    stop_launch_server()
    child = subprocess.Popen([sys.executable, "-c", _GROUPS_OF_EVERY_RANK,
                              json.dumps([[list(shape), list(names)] for shape, names in meshes])],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    found = []
    try:
        for line in child.stdout:
            found.append({int(rank): groups for rank, groups in json.loads(line).items()})
            if each is not None:
                each(len(found) - 1)
        _, errors = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    if child.returncode != 0:
        raise RuntimeError(errors.strip().splitlines()[-1])
    return found


def mesh_groups(shape: tuple[int, ...], names: tuple[str, ...]) -> dict[int, dict[str, list[int]]]:
    """Every rank's group along each mesh dimension of one mesh, as torch's init_device_mesh builds them."""
    return mesh_groups_of([(shape, names)])[0]


def check_mesh_for(mesh_for: Callable[[int, int], Any],
                   clusters: tuple[tuple[int, int], ...] = ((2, 4), (4, 2), (3, 8))) -> bool:
    """The second exercise: mesh_for(nodes, gpus_per_node) -> (mesh_shape, mesh_dim_names) must put "tp" on
    the GPUs of one node and "dp" across nodes, with torchrun's numbering (rank = node * gpus_per_node + local)."""
    import math

    meshes = []
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
        meshes.append((shape, names))
    print(f"Asking torch's init_device_mesh for every rank's groups on {len(clusters)} clusters (one child process, "
          "torch's fake backend; a few seconds)...", flush=True)
    done = lambda i: print(f"  {clusters[i][0]} nodes x {clusters[i][1]} GPUs: groups of all "  # noqa: E731
                           f"{math.prod(clusters[i])} ranks read", flush=True)
    for (nodes, gpus), groups in zip(clusters, mesh_groups_of(meshes, done), strict=True):
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


# ---------------------------------------------------------------------------- pictures drawn from the runs

def _holder_colours(holders: list[tuple[int, ...]]) -> dict[tuple[int, ...], Any]:
    """One colour per set of ranks: a single rank its own strong colour, a set of ranks a pale colour of its own."""
    import matplotlib.colors as mcolors

    strong = ("tab:blue", "tab:orange", "tab:green", "tab:red")
    pale = ("#c6dbef", "#fdd0a2", "#c7e9c0", "#fcbba1", "#dadaeb", "#d9d9d9")
    shared = [h for h in holders if len(h) > 1]
    return {h: mcolors.to_rgb(strong[h[0] % 4] if len(h) == 1 else pale[shared.index(h) % len(pale)])
            for h in holders}


def mesh_figure(coordinates: list[list[int]], groups: list[dict[str, list[int]]]) -> Any:
    """The 2 x 2 mesh as the ranks reported it: each rank at its coordinate, its tp group (row) and dp group
    (column) drawn as the loops that join the ranks of each group."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.2, 3.2))
    at = {rank: (coordinate[1], -coordinate[0]) for rank, coordinate in enumerate(coordinates)}
    drawn = set()
    for rank in range(len(coordinates)):
        for name, colour, pad in (("tp", "tab:purple", 0.28), ("dp", "tab:green", 0.36)):
            members = tuple(groups[rank][name])
            if (name, members) in drawn:
                continue
            drawn.add((name, members))
            xs, ys = [at[m][0] for m in members], [at[m][1] for m in members]
            ax.add_patch(plt.Rectangle((min(xs) - pad, min(ys) - pad), max(xs) - min(xs) + 2 * pad,
                                       max(ys) - min(ys) + 2 * pad, fill=False, edgecolor=colour, linewidth=2,
                                       linestyle="-" if name == "tp" else "--"))
    for rank, (x, y) in at.items():
        ax.text(x, y, f"rank {rank}\n{tuple(coordinates[rank])}", ha="center", va="center", fontsize=10)
    ax.plot([], [], color="tab:purple", label="tp group (a row)")
    ax.plot([], [], color="tab:green", linestyle="--", label="dp group (a column)")
    ax.set(xlim=(-0.6, 1.6), ylim=(-1.9, 0.6), xticks=[], yticks=[],
           title="init_device_mesh((2, 2)), as the ranks saw it")
    ax.legend(loc="lower center", ncol=2, fontsize="small", frameon=False)
    return fig


def placements_figure(pieces: list[dict[str, dict[str, Any]]], shown: list[str]) -> Any:
    """Who holds what of torch.arange(16).reshape(4, 4) under each placement in `shown`: every element coloured by
    the set of ranks whose local piece holds it (each value occurs once in the whole, so a value is a position)."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(shown), figsize=(3.1 * len(shown), 3.2))
    for ax, placement in zip(np.atleast_1d(axes), shown, strict=True):
        holders: dict[int, list[int]] = {value: [] for value in range(16)}
        for rank, by_placement in enumerate(pieces):
            for value in np.array(by_placement[placement]["local"]).flatten().tolist():
                holders[int(value)].append(rank)
        colours = _holder_colours(sorted({tuple(h) for h in holders.values()}))
        ax.imshow([[colours[tuple(holders[4 * row + column])] for column in range(4)] for row in range(4)])
        for value, ranks in holders.items():
            ax.text(value % 4, value // 4, ",".join(map(str, ranks)), ha="center", va="center", fontsize=9)
        ax.set(title=placement.replace("Shard(dim=", "Shard(").replace("), ", "),\n"), xticks=[], yticks=[])
    fig.suptitle("which ranks hold each element (the number in the cell)", fontsize="medium")
    fig.tight_layout()
    return fig


def holdings_figure(results: dict[int, dict[str, Any]], layouts: list[str], parameter: str) -> Any:
    """Who holds what of one weight under each layout, from the rows and columns each rank reported holding."""
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(layouts), figsize=(2.7 * len(layouts), 2.9))
    for ax, layout in zip(np.atleast_1d(axes), layouts, strict=True):
        held = {rank: results[rank][layout]["held"][parameter] for rank in sorted(results)}
        rows = 1 + max(max(h["rows"]) for h in held.values())
        columns = 1 + max(max(h["columns"]) for h in held.values())
        owners = [[[] for _ in range(columns)] for _ in range(rows)]
        for rank, h in held.items():
            for row in h["rows"]:
                for column in h["columns"]:
                    owners[row][column].append(rank)
        colours = _holder_colours(sorted({tuple(o) for line in owners for o in line}))
        ax.imshow([[colours[tuple(o)] for o in line] for line in owners], aspect="auto")
        for holder in colours:
            cells = [(r, c) for r in range(rows) for c in range(columns) if tuple(owners[r][c]) == holder]
            (r0, c0), (r1, c1) = min(cells), max(cells)
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, ",".join(map(str, holder)), ha="center", va="center", fontsize=9)
        ax.set(title=layout, xticks=[0, columns - 1], yticks=[0, rows - 1])
    fig.suptitle(f"{parameter} [{rows}, {columns}]: the ranks that hold each element", fontsize="medium")
    fig.tight_layout()
    return fig


def counts_figure(counts: dict[str, dict[str, Counter]]) -> Any:
    """Collectives per training step by mesh dimension, forward and backward, for each layout (from the run)."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(counts), figsize=(3.4 * len(counts), 2.9))
    for ax, (layout, by_phase) in zip(axes, counts.items(), strict=True):
        keys = sorted({key for phase in ("forward", "backward") for key in by_phase[phase]})
        for offset, phase in ((-0.2, "forward"), (0.2, "backward")):
            ax.barh([i + offset for i in range(len(keys))], [by_phase[phase].get(k, 0) for k in keys], height=0.4,
                    label=phase)
        ax.set_yticks(range(len(keys)), [k.replace("_", " ") for k in keys], fontsize="small")
        ax.set(title=layout, xlabel="calls per step")
    # one legend for all panels, under them, where it covers no bar
    fig.legend(*axes[0].get_legend_handles_labels(), loc="lower center", ncol=2, fontsize="small")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    return fig


def source_of(path: str | os.PathLike, name: str) -> str:
    """The source of the top-level function `name` in the file at `path` (read, not imported)."""
    import ast

    text = Path(path).read_text()
    for node in ast.parse(text).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return ast.get_source_segment(text, node)
    raise ValueError(f"{Path(path).name} has no top-level function {name!r}")


def layout_gaps(results: dict[int, dict[str, Any]], layouts: list[str], reference: list[float]) -> dict[str, dict]:
    """For each layout, what the lesson checks against one process and between ranks:
    loss: the largest |loss - one process's| over the steps (rank 0; the loss is all-reduced);
    gradient: the largest |gradient - one process's| at step 0 over the ranks;
    same dp / other dp: the largest gap between the own losses (before the all-reduce) of two ranks of one dp index
    (None when each dp index has one rank), and the smallest such gap between ranks of different dp indices;
    rows: the rows each dp index took at step 0, in dp order."""
    def gap(first: list[float], second: list[float]) -> float:
        return max(abs(a - b) for a, b in zip(first, second, strict=True))

    out = {}
    for name in layouts:
        by_dp: dict[int, list[dict]] = {}
        for rank in sorted(results):
            by_dp.setdefault(results[rank][name]["dp_index"], []).append(results[rank][name])
        firsts = [ranks[0] for _, ranks in sorted(by_dp.items())]
        same = [gap(seen["local_losses"], ranks[0]["local_losses"]) for ranks in by_dp.values() for seen in ranks[1:]]
        out[name] = {"loss": gap(results[0][name]["losses"], reference),
                     "gradient": max(results[rank][name]["grad_gap"] for rank in results),
                     "same dp": max(same, default=None),
                     "other dp": min(gap(a["local_losses"], b["local_losses"])
                                     for i, a in enumerate(firsts) for b in firsts[i + 1:]),
                     "same rows within dp": all(seen["rows_step0"] == ranks[0]["rows_step0"]
                                                for ranks in by_dp.values() for seen in ranks),
                     "rows": [row for ranks in (by_dp[i] for i in sorted(by_dp)) for row in ranks[0]["rows_step0"]]}
    return out
