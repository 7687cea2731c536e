"""Three DDP options, measured: find_unused_parameters, static_graph, gradient_as_bucket_view.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_options.py --rounds 5

For each setting: its time per step, DDP's buckets, and how many separate gradient buffers exist
(gradient_as_bucket_view makes each .grad a view into DDP's bucket, so gradients are not stored twice). The four
settings take turns in one launch (helpers/kit/timing.py: a shuffled order each round, the same on every rank, after
a warm-up round, each turn after a barrier), wall time and CPU time side by side; the steps zero the gradients with
set_to_none=False. gradient_as_bucket_view is then run again with set_to_none=False and with set_to_none=True,
profiling one backward: the gradients end in the buckets either way (the reducer re-points a fresh .grad at its
bucket view), but only with set_to_none=False does the reducer skip copying each gradient into its bucket
(Reducer::mark_variable_ready_dense, reducer.cpp: "If grad has already been set as views of buckets in previous
iterations, no copy is needed"). Last, a model with a branch it never uses, without
find_unused_parameters: DDP waits for gradients that never come and says so on the next iteration; and a
model with a frozen layer, which needs no find_unused_parameters if it is frozen before DDP wraps the model (DDP
registers only the parameters that require grad, when it is constructed), and fails like the unused branch if it
is frozen after.
gloo on CPU, nccl on GPUs.
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, profile

from helpers.kit.distributed import init_distributed
from helpers.kit.models import mlp
from helpers.kit.reporting import result
from helpers.kit.timing import take_turns

SETTINGS = {
    "default": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
    "gradient_as_bucket_view": {"gradient_as_bucket_view": True},
}


class WithUnusedBranch(nn.Module):
    """A model whose `spare` layer takes no part in the loss (like a head used only sometimes)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.spare = nn.Linear(8, 4), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def training_step(model: DDP, images: torch.Tensor, labels: torch.Tensor):
    """A function that runs one training step of `model`."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        # set_to_none=False keeps the .grad tensors, so with gradient_as_bucket_view the next backward accumulates
        # straight into the bucket views. With set_to_none=True (the default) .grad is None, autograd makes a fresh
        # gradient, and the reducer copies it into the bucket and re-points .grad at the bucket view: the memory
        # is saved either way, the copy only with set_to_none=False (Reducer::mark_variable_ready_dense in
        # reducer.cpp; the batched_grad_copy entry of DDP's docstring, torch/nn/parallel/distributed.py:782-791).
        optimizer.zero_grad(set_to_none=False)
        torch.nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()
        if images.is_cuda:
            torch.cuda.synchronize()
    return step


REDUCER_COPIES = ("torch::distributed::reducer::mul_out", "torch::distributed::reducer::copy_")


def bucket_view_copies(device: torch.device, set_to_none: bool, images: torch.Tensor, labels: torch.Tensor) -> dict:
    """gradient_as_bucket_view=True, zeroing with `set_to_none`: after 3 steps, profile one backward and count the
    reducer's gradient-to-bucket copies (its record_function names, REDUCER_COPIES) and the gradients' storages."""
    torch.manual_seed(0)
    model = DDP(mlp(256, 14).to(device), gradient_as_bucket_view=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(4):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        if step == 3:
            with profile(activities=[ProfilerActivity.CPU]) as prof:  # the reducer's copies are CPU-side records
                loss.backward()
            copies = sum(event.name in REDUCER_COPIES for event in prof.events())
        else:
            loss.backward()
        optimizer.step()
    grads = [p.grad for p in model.parameters()]
    return {"set_to_none": set_to_none, "parameters": len(grads), "reducer_copies": copies,
            "grad_storages": len({g.untyped_storage().data_ptr() for g in grads})}


def unused_branch_error(device: torch.device) -> str:
    """Train two steps with an unused layer and default settings; return DDP's complaint."""
    model = DDP(WithUnusedBranch().to(device))
    try:
        for _ in range(2):
            model(torch.rand(4, 8, device=device)).sum().backward()
    except RuntimeError as error:
        return str(error).split(". ")[0] + "."
    return "no error"


def frozen_head(device: torch.device, after_wrapping: bool = False) -> dict:
    """A frozen layer (requires_grad_(False)) under default DDP, frozen before DDP wraps the model (or after): 3 steps,
    and how many tensors DDP registered, or DDP's complaint."""
    model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4)).to(device)
    if not after_wrapping:
        model[1].requires_grad_(False)  # frozen first: DDP only registers parameters that require grad
    ddp = DDP(model)
    if after_wrapping:
        model[1].requires_grad_(False)  # frozen too late: DDP registered it and waits for its gradient
    for step in range(3):
        try:
            ddp(torch.rand(4, 8, device=device)).sum().backward()
        except RuntimeError as error:
            return {"error": str(error).split(". ")[0] + ".", "iteration": step + 1}
    return {"steps": 3, "parameters": len(list(model.parameters())),
            "registered": int(ddp._get_ddp_logging_data()["num_parameter_tensors"])}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--turn-steps", type=int, default=3, help="steps per turn")
    parser.add_argument("--per-rank-batch", type=int, default=32)
    args = parser.parse_args()

    rank, _, device = init_distributed()
    torch.manual_seed(rank)
    images = torch.rand(args.per_rank_batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (args.per_rank_batch,), device=device)

    models = {}
    for name, options in SETTINGS.items():
        torch.manual_seed(0)
        models[name] = DDP(mlp(256, 14).to(device), **options)
    # one warm-up round: DDP rebuilds its buckets at the second step, static_graph records the graph in the first
    timings = take_turns({name: training_step(model, images, labels) for name, model in models.items()},
                         rounds=args.rounds, warmup=1, repeat=args.turn_steps, between=dist.barrier)
    result(timings={name: timing.as_dict() for name, timing in timings.items()})
    for name, model in models.items():
        grads = [p.grad for p in model.parameters()]
        storages = len({g.untyped_storage().data_ptr() for g in grads})
        grad_mib = sum(g.numel() * g.element_size() for g in grads) / 2**20
        logged = model._get_ddp_logging_data()  # no rebuild with find_unused_parameters: the first buckets stay
        buckets = str(logged.get("rebuilt_bucket_sizes") or logged.get("bucket_sizes", ""))
        result(**{name: {"grad_storages": storages, "parameters": len(grads), "grad_mib": round(grad_mib, 2),
                         "buckets": len(buckets.split(", ")) if buckets else 0}})
    result(bucket_view_zeroing=[bucket_view_copies(device, stn, images, labels) for stn in (False, True)])
    result(unused_error=unused_branch_error(device), frozen_head=frozen_head(device),
           frozen_after_wrapping=frozen_head(device, after_wrapping=True))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
