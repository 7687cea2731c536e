"""torch.compile with FSDP2 (fully_shard): what changes, counted as for DDP.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_fsdp.py

The model of faster_compile.py (helpers.kit.faster_step.build_model(512, 3)), each Block and the root given to
fully_shard, trained 3 steps on each rank's own digits four ways from the same weights: eager; each Block compiled
on its own before fully_shard (`block.compile()`); the same with fullgraph=True (torchtitan's apply_compile: a
graph break inside a block would raise); the whole model compiled. The backend counts the graphs dynamo hands it
(helpers.kit.faster_step.GraphCounter, then torch's aot_eager), and dynamo's own counters say which frames it
compiled and why it gave up on others. FSDP2's default collectives call dist.all_gather_single and
dist.reduce_scatter_single (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py), attributes of
torch.distributed that helpers.kit.zero.CommLog wraps, so it counts them per step. Each rank hands back the graphs,
the collectives of each step, and how far its gradient shards are from eager FSDP2's. On GPUs (nccl) fully_shard puts
the shards on this rank's GPU and the batches go there too. Works with one process.
"""
import re

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import (
    GraphCounter,
    build_model,
    digits_batches,
    prepare_compile,
    release,
    remove_compile_caches,
    remove_compile_caches_when_stopped,
    still_working,
)
from helpers.kit.reporting import progress, result
from helpers.kit.zero import CommLog, is_call

WIDTH, DEPTH, STEPS = 512, 3, 3
WAYS = ("eager", "each block compiled", "each block, fullgraph=True", "whole model compiled")


def sharded(how: str, backend: GraphCounter):
    model = build_model(WIDTH, DEPTH)
    for block in model.blocks:
        if how.startswith("each block"):
            block.compile(backend=backend, fullgraph=how.endswith("fullgraph=True"))
        fully_shard(block)
    fully_shard(model)
    return torch.compile(model, backend=backend) if how == "whole model compiled" else model


def train(model, batches, log: CommLog) -> dict:
    steps = []
    for batch in batches:
        model.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        steps.append([{"op": e["op"], "bytes": e["bytes"]} for e in log.take() if is_call(e)])  # not the waits
    gradients = [p.grad.to_local().detach().clone() for p in model.parameters()]
    return {"steps": steps, "gradients": gradients}


def dynamo_said() -> dict:
    """dynamo's own counters since they were cleared: frames it was asked to compile and compiled, and why it gave
    up (each reason's headlines, and the frames it skipped: "forward (faster_step.py line N)")."""
    reasons = list(counters["unimplemented"]) + list(counters["graph_break"])
    skipped = sorted({f"{m[1]} ({m[2].rsplit('/', 1)[-1]} line {m[3]})" for reason in reasons
                      for m in re.finditer(r"frame skipped: (\w+) \((.+?) line (\d+)\)", reason)})
    headlines = {line.strip() for reason in reasons for line in reason.splitlines()
                 if line.strip() and not line.startswith((" ", "Developer", "For more", "***"))}
    return {"frames": dict(counters["frames"]), "reasons": sorted(headlines), "skipped_frames": skipped}


def main() -> None:
    cache = prepare_compile()
    rank, world_size, device = init_distributed()
    batches = digits_batches(rank, 32, STEPS, device)
    log = CommLog().install()
    runs = {}
    for index, how in enumerate(WAYS):
        torch._dynamo.reset()
        counters.clear()
        backend = GraphCounter("aot_eager")
        with still_working(f"rank 0: FSDP2, {how}", enabled=rank == 0):
            model = sharded(how, backend)
            log.take()
            runs[how] = train(model, batches, log)
        runs[how]["graphs"], runs[how]["dynamo"] = backend.graphs, dynamo_said()
        progress(index + 1, len(WAYS))
    eager = runs["eager"]["gradients"]
    for run in runs.values():
        run["max_difference"] = max((a - b).abs().max().item() for a, b in zip(run.pop("gradients"), eager,
                                                                                 strict=True))
    log.uninstall()
    result(runs=runs, world_size=world_size, cache=cache)
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    remove_compile_caches_when_stopped()  # Stop (a SIGTERM) runs no `finally`
    try:
        main()
    finally:  # after main's last barrier (release); also when it fails
        remove_compile_caches()
