"""torch.compile with FSDP2 (fully_shard): what changes, counted as for DDP.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_fsdp.py

The model of faster_compile.py (helpers.kit.faster_step.build_model(512, 3)), each Block and the root given to
fully_shard, trained 3 steps on each rank's own digits three ways from the same weights: eager; each Block compiled
on its own (torchtitan's recipe: `block.compile()` before fully_shard); the whole model compiled. The backend counts
the graphs dynamo hands it (helpers.kit.faster_step.GraphCounter, then torch's aot_eager). Every collective FSDP2
issues goes through torch.distributed's functions (dist.all_gather_into_tensor, dist.reduce_scatter_tensor), so
helpers.kit.zero.CommLog counts them per step. Each rank hands back the graphs, the collectives of the last step, and
how far its gradient shards are from eager FSDP2's. Works with one process.
"""
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import GraphCounter, build_model, digits_batches, prepare_compile, release, still_working
from helpers.kit.reporting import progress, result
from helpers.kit.zero import CommLog, is_call

WIDTH, DEPTH, STEPS = 512, 3, 3


def sharded(how: str, backend: GraphCounter):
    model = build_model(WIDTH, DEPTH)
    for block in model.blocks:
        if how == "each block compiled":
            block.compile(backend=backend)
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


def main() -> None:
    prepare_compile()
    rank, world_size, _ = init_distributed()
    batches = digits_batches(rank, 32, STEPS)
    log = CommLog().install()
    runs = {}
    for index, how in enumerate(("eager", "each block compiled", "whole model compiled")):
        torch._dynamo.reset()
        backend = GraphCounter("aot_eager")
        with still_working(f"rank 0: FSDP2, {how}", enabled=rank == 0):
            model = sharded(how, backend)
            log.take()
            runs[how] = train(model, batches, log)
        runs[how]["graphs"] = backend.graphs
        progress(index + 1, 3)
    eager = runs["eager"]["gradients"]
    for run in runs.values():
        run["max_difference"] = max((a - b).abs().max().item() for a, b in zip(run.pop("gradients"), eager,
                                                                                 strict=True))
    log.uninstall()
    result(runs=runs, world_size=world_size)
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
