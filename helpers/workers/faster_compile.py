"""torch.compile on a DDP model: where DDP's buckets split the graph, the first-bucket rule, inductor's compile time
against its step time, and compiled autograd.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_compile.py

The model: helpers.kit.faster_step.build_model(512, 3), 932,362 parameters (3.7 MB of fp32 gradients).
1. With a C++ compiler: inductor on the default setting; the first step's time (compilation) against later steps,
   the gradients of the first step against eager DDP's from the same weights, and compiled against eager steps
   under the timing protocol. Without one: the reason (helpers.kit.faster_step.NO_COMPILER). First, while the
   workers are small: see inductor() for why rank 0 compiles alone first.
2. For bucket_cap_mb = 1, None (DDP's default: 25 MiB, first bucket 1 MiB) and 25, torch.compile(DDP(model)) with a
   backend of ours that counts the graphs dynamo hands it and the parameter bytes each one takes, then runs torch's
   "aot_eager" (which compiles nothing: the split is made before any backend sees a graph). Beside it, torch's own
   log line ("DDPOptimizer used bucket cap ... and created N buckets") and the buckets DDP's reducer all-reduced
   (torch's allreduce_hook, counted).
3. bucket_cap_mb = 0.25: the error torch raises, caught and handed back; and the graphs of DDP over an nn.Sequential.
4. Compiled autograd (torch._dynamo.config.compiled_autograd with optimize_ddp="python_reducer"): the train step
   compiled whole with aot_eager; the graphs, and the all-reduces inside the backward graph. Last, because
   python_reducer changes global settings of dynamo and inductor.
On GPUs (nccl) the models and batches go to this rank's GPU, inductor writes Triton kernels instead of C++ (no C++
compiler check), and every timed step waits for its kernels. Works with one process.
"""
import argparse
import logging
import time

import torch
import torch._dynamo  # sets up torch's loggers now, so that TorchLog's settings below are not reset later
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import (
    GraphCounter,
    NoCompiler,
    build_model,
    digits_batches,
    flat_grad,
    prepare_compile,
    release,
    remove_compile_caches,
    remove_compile_caches_when_stopped,
    require_cxx,
    still_working,
    synchronize,
)
from helpers.kit.instruments import AllreduceCounter, counting_allreduce_hook
from helpers.kit.models import mlp
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns

WIDTH, DEPTH = 512, 3
DEVICE = torch.device("cpu")  # this rank's device, set in main()
CAPS = {"1 MiB": 1, "default (25 MiB, first 1 MiB)": None, "25 MiB": 25}


class TorchLog(logging.Handler):
    """Keeps the messages of torch's DDPOptimizer logger (torch/_dynamo/backends/distributed.py)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []
        logger = logging.getLogger("torch._dynamo.backends.distributed")
        for handler in list(logger.handlers):  # torch's own stderr handler: the notebook prints the lines it keeps
            if getattr(handler, "_torch_logging_internal_handler", False):
                logger.removeHandler(handler)
        logger.setLevel(logging.INFO)
        logger.addHandler(self)
        logger.propagate = False

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage().strip())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


def train_step(model, batch) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
    loss.backward()
    synchronize(DEVICE)
    return loss


def ddp(cap_mb, counter: AllreduceCounter | None = None) -> DDP:
    module = build_model(WIDTH, DEPTH).to(DEVICE)
    model = DDP(module) if cap_mb is None else DDP(module, bucket_cap_mb=cap_mb)
    if counter is not None:
        model.register_comm_hook(counter, counting_allreduce_hook)
    return model


def graph_splits(batches, torch_log: TorchLog) -> dict:
    splits = {}
    torch_log.take()  # lines of earlier compiles
    for name, cap in CAPS.items():
        torch._dynamo.reset()
        counter, backend = AllreduceCounter(), GraphCounter("aot_eager")
        compiled = torch.compile(ddp(cap, counter), backend=backend)
        for batch in batches[:3]:  # DDP rebuilds its buckets after step 0
            counter.reset()
            train_step(compiled, batch)
        splits[name] = {"graphs": backend.graphs, "ddp_buckets": [4 * n for n in counter.bucket_numels],
                        "torch_log": [line for line in torch_log.take() if "DDPOptimizer" in line]}
    return splits


def sequential_graphs(batch) -> int:
    """Graphs dynamo makes of DDP over an nn.Sequential (lesson 03's mlp), whose forward is torch.nn's own."""
    torch._dynamo.reset()
    backend = GraphCounter("aot_eager")
    train_step(torch.compile(DDP(mlp(256, 2).to(DEVICE)), backend=backend), batch)
    return len(backend.graphs)


def first_bucket_rule(batch) -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(ddp(0.25), backend=GraphCounter("aot_eager"))
    try:
        train_step(compiled, batch)
    except Exception as error:  # torch wraps the backend's AssertionError in its own exception
        cause = error
        while cause.__cause__ is not None:
            cause = cause.__cause__
        return {"raised": type(error).__name__, "cause": type(cause).__name__, "message": str(cause)}
    return {"raised": None}


def inductor(batches, rounds: int) -> dict:
    """Rank 0 first compiles alone (a DDP over a group of its own, so no other rank waits in a collective), into the
    launch's empty cache; then every rank compiles the real 2-rank model, reading that cache. One C++ compiler runs
    at a time, and the run shows a cold compile beside a warm one. Rank 1 only waits meanwhile: it has not imported
    inductor yet, which keeps the launch's memory down while the C++ compiler runs."""
    alone = dist.new_group([0])  # every rank takes part in making a group, members or not
    found = [None, None]  # rank 0's compiler (or why there is none), and its cold first step
    if dist.get_rank() == 0:
        try:
            found[0] = require_cxx() if DEVICE.type == "cpu" else "none needed (Triton, on the GPU)"
        except NoCompiler as error:
            found[0] = error
        if not isinstance(found[0], NoCompiler):
            solo = torch.compile(DDP(build_model(WIDTH, DEPTH).to(DEVICE), process_group=alone), backend="inductor")
            start = time.perf_counter()
            train_step(solo, batches[0])
            found[1] = time.perf_counter() - start
    dist.broadcast_object_list(found, src=0)
    compiler, cold = found
    if isinstance(compiler, NoCompiler):
        return {"skipped": str(compiler)}
    torch._dynamo.reset()
    eager, backend, compiled_ddp = ddp(None), GraphCounter("inductor"), ddp(None)
    compiled = torch.compile(compiled_ddp, backend=backend)
    start = time.perf_counter()
    train_step(compiled, batches[0])
    warm = time.perf_counter() - start
    train_step(eager, batches[0])
    difference = (flat_grad(compiled_ddp) - flat_grad(eager)).abs().max().item()
    scale = flat_grad(eager).abs().max().item()
    timings = take_turns({"compiled": lambda: train_step(compiled, batches[1]),
                          "eager": lambda: train_step(eager, batches[1])},
                         rounds=rounds, warmup=2, repeat=3, between=dist.barrier)
    return {"compiler": compiler, "cold_first_step_s": cold, "warm_first_step_s": warm, "graphs": backend.graphs,
            "max_difference": difference, "largest_gradient": scale,
            "timings": {name: t.as_dict() for name, t in timings.items()}}


def compiled_autograd(batches) -> dict:
    torch._dynamo.reset()
    torch._dynamo.config.optimize_ddp = "python_reducer"
    torch._dynamo.config.compiled_autograd = True
    eager, model = ddp(None), ddp(None)  # built after the switch: DDP reads it in its constructor
    backend = GraphCounter("aot_eager")

    @torch.compile(backend=backend)
    def forward_and_backward(batch):
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()

    graphs_per_step = []
    for batch in batches:
        model.zero_grad(set_to_none=True)  # outside: dynamo would guard on `p.grad is None` and compile again
        before = len(backend.graphs)
        forward_and_backward(batch)
        graphs_per_step.append(len(backend.graphs) - before)
    torch._dynamo.config.compiled_autograd = False
    train_step(eager, batches[-1])
    return {"graphs": backend.graphs, "graphs_per_step": graphs_per_step,
            "parameters": len(list(model.parameters())),
            "max_difference": (flat_grad(model) - flat_grad(eager)).abs().max().item()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--parts", default="inductor,splits,autograd", help="which parts to run (the tests run one)")
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    global DEVICE
    cache = prepare_compile()
    rank, world_size, DEVICE = init_distributed()
    torch_log = TorchLog()
    batches = digits_batches(rank, 32, 3, DEVICE)
    talk, found = rank == 0, {}
    if "inductor" in parts:
        with still_working("rank 0: inductor, rank 0 alone first (cold cache), then both ranks (warm)", enabled=talk):
            found["inductor"] = inductor(batches, args.rounds)
            progress(1, 4)
    if "splits" in parts:
        with still_working("rank 0: the graphs of 3 bucket settings (aot_eager), and bucket_cap_mb=0.25",
                           enabled=talk):
            found["splits"] = graph_splits(batches, torch_log)
            progress(2, 4)
            found["first_bucket_rule"] = first_bucket_rule(batches[0])
            found["sequential_graphs"] = sequential_graphs(batches[0])
            progress(3, 4)
    if "autograd" in parts:
        with still_working("rank 0: compiled autograd (aot_eager)", enabled=talk):
            found["compiled_autograd"] = compiled_autograd(batches)
            progress(4, 4)
    result(**found, parameter_bytes=[4 * p.numel() for p in build_model(WIDTH, DEPTH).parameters()],
           world_size=world_size, cache=cache)
    torch._dynamo.reset()  # the compiled models it keeps go first, on this thread
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    remove_compile_caches_when_stopped()  # Stop (a SIGTERM) runs no `finally`
    try:
        main()
    finally:  # after main's last barrier (release); also when it fails
        remove_compile_caches()
