"""Worker kit for lesson 13 (a faster step): the lesson's model, torch.compile's set-up on a CPU, and instruments.

    from helpers.kit.faster_step import build_model, digits_batches, prepare_compile, require_cxx, GraphCounter

- `build_model(width, depth)`: 784 -> width -> (width -> width) x (depth - 1) -> 10 in `Block`s defined here, not
  an nn.Sequential: torch.compile compiles a module's forward that lives in your own file, and the lesson counts
  the graphs it makes per block.
- `prepare_compile()`: before the first torch.compile in a process: one compile thread (inductor's compile_threads,
  so a learner's memory stays in budget), the compile caches in a temporary folder of this launch, shared by its
  ranks (never the repository); `remove_compile_caches()` removes it, in the worker's `finally` (the launch
  server's workers end with os._exit, which runs no atexit handler), and `remove_compile_caches_when_stopped()`
  when a stopped launch SIGTERMs the worker.
- `require_cxx()`: the C++ compiler inductor needs on a CPU, found by torch's own lookup; without one, `NoCompiler`
  says so in one sentence, instead of torch's error deep inside the first compiled step.
- `still_working(what)`: a line at once, then one every few seconds, while a compile runs.
- `GraphCounter`: a torch.compile backend that records each graph dynamo hands it (parameters, operations,
  collectives) and then runs torch's own backend on it ("aot_eager" by default, "inductor" for real code).
- `local_gradient`, `average`, `exact_average`, `flat_grad`, `relative_error`, `fit_residual`: the lesson's gradient
  error, ||got - exact|| / ||exact||, against the exact average of the ranks' gradients (over a process group), and
  how close a gradient is to a multiple of another (the exercise's check names a mistake by it).
- `synchronize(device)`: before a clock is read on a GPU (a no-op on the CPU).
- `release(...)`: what a worker with comm hooks does before destroy_process_group (see its docstring).

No `from __future__ import annotations` here: DDP checks a comm hook's return annotation when it is registered.
"""
import contextlib
import gc
import itertools
import os
import shutil
import signal
import tempfile
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from helpers.kit.data import digits_as_mnist

NO_COMPILER = ("torch.compile's default backend, inductor, turns each graph into C++ on a CPU and needs a C++ "
               "compiler; torch found none ({detail}). Install one (Debian or Ubuntu: `sudo apt-get install g++`; "
               "macOS: `xcode-select --install`), or name one in the CXX environment variable before you start "
               "Jupyter, then restart the kernel. Everything in the lesson that does not compile with inductor "
               "runs without it.")


class NoCompiler(RuntimeError):
    """Inductor cannot run here: no working C++ compiler."""


class Block(nn.Module):
    """One Linear and its ReLU: a unit the lesson compiles, shards and counts."""

    def __init__(self, width_in: int, width_out: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class StepModel(nn.Module):
    """784 -> width (Block) -> width (Block) x (depth - 1) -> 10 (Linear head)."""

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        widths = [28 * 28] + [width] * depth
        self.blocks = nn.ModuleList(Block(a, b) for a, b in itertools.pairwise(widths))
        self.head = nn.Linear(width, 10)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = images.flatten(1)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_model(width: int = 256, depth: int = 2, seed: int = 0) -> StepModel:
    """The lesson's model; the same seed gives the same weights on every rank."""
    torch.manual_seed(seed)
    return StepModel(width, depth)


def digits_batches(rank: int, per_rank_batch: int, count: int, device: torch.device | str = "cpu"
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of the handwritten digits that ship with the lessons, a different slice on each rank (the same
    on every machine: no download), on `device`."""
    images, labels = digits_as_mnist(train=True)
    generator = torch.Generator().manual_seed(rank)
    order = torch.randperm(len(labels), generator=generator)
    batches = []
    for index in range(count):
        take = order[(torch.arange(per_rank_batch) + index * per_rank_batch) % len(labels)]
        batches.append((images[take].to(device), labels[take].to(device)))
    return batches


def require_cxx() -> str:
    """The C++ compiler inductor will use (torch's own lookup, torch/_inductor/cpp_builder.py, get_cpp_compiler);
    NoCompiler with what to do when there is none."""
    from torch._inductor import cpp_builder, exc
    try:
        return cpp_builder.get_cpp_compiler()
    except exc.InvalidCxxCompiler as error:
        raise NoCompiler(NO_COMPILER.format(detail=error)) from None


_CACHES: list[str] = []  # the folders prepare_compile made in this process, for remove_compile_caches


def prepare_compile() -> str:
    """One compile thread; the compile caches in a temporary folder of this launch, the same for every rank (so that
    a rank can read what another compiled); returns that folder, which remove_compile_caches() removes. Whether
    inductor can compile here is require_cxx's question."""
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    launch_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or str(os.getpid())
    cache = os.path.join(tempfile.gettempdir(), f"lesson13-compile-cache-{launch_id}")
    os.makedirs(cache, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    _CACHES.append(cache)
    import torch._inductor.config as inductor_config
    inductor_config.compile_threads = 1  # workers forked from the launch server inherit its config, already read
    return cache


def remove_compile_caches() -> None:
    """Remove the folders prepare_compile made in this process: call it in the worker's `finally`, after the ranks'
    last barrier (another rank may still read the shared cache before it). Not atexit: a worker forked by the
    launch server ends with os._exit (helpers/launcher/server.py), which runs no atexit handler, and the folders
    stayed in /tmp."""
    while _CACHES:
        shutil.rmtree(_CACHES.pop(), ignore_errors=True)


def remove_compile_caches_when_stopped() -> None:
    """In a worker's main thread: on SIGTERM, remove the compile caches, then end by SIGTERM as before. A stopped
    launch (Stop, a timeout) SIGTERMs its workers and SIGKILLs them a second later; by default SIGTERM ends a process
    without running its `finally`, and the folder stayed in /tmp. Python runs the handler when the main thread next
    runs Python code: a rank waiting inside a C++ collective may not before the SIGKILL, but the folder is shared by
    the ranks, and the rank that compiles (or waits for the C++ compiler, which gets the SIGTERM too) runs it."""
    def stopped(signum: int, frame: Any) -> None:
        remove_compile_caches()
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, stopped)


@contextlib.contextmanager
def still_working(what: str, every: float = 4.0, enabled: bool = True):
    """Print `what` at once, then "<what>: still working after N s" every `every` seconds until the block ends (a
    compile can take half a minute without a word of its own). enabled=False: silent (the other ranks)."""
    started, done = time.monotonic(), threading.Event()
    if enabled:
        print(what, flush=True)

    def tick() -> None:
        while enabled and not done.wait(every):
            print(f"{what}: still working after {time.monotonic() - started:.0f} s", flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    try:
        yield
    finally:
        done.set()
        ticker.join()


class GraphCounter:
    """A torch.compile backend that records every graph dynamo hands it, then compiles it with torch's `backend`.

    Per graph: the bytes of the parameters it takes (dynamo passes them as inputs), its operations, and the
    collectives in it (compiled autograd puts DDP's all-reduces into the backward graph)."""

    def __init__(self, backend: str = "aot_eager") -> None:
        from torch._dynamo.backends.registry import lookup_backend
        self.backend, self.compile = backend, lookup_backend(backend)
        self.graphs: list[dict[str, Any]] = []

    def __call__(self, graph_module: torch.fx.GraphModule, example_inputs: list) -> Any:
        calls = [node for node in graph_module.graph.nodes if node.op == "call_function"]
        self.graphs.append({
            "parameter_bytes": sum(t.numel() * t.element_size() for t in example_inputs
                                   if isinstance(t, nn.Parameter)),
            "operations": len(calls),
            "collectives": [str(node.target) for node in calls if "_c10d_functional" in str(node.target)
                            and "wait" not in str(node.target)],
        })
        return self.compile(graph_module, example_inputs)


def release(*holders: Any) -> None:
    """Before destroy_process_group: drop DDP models with comm hooks (and whatever holds them), collect them on the
    main thread, and let gloo's threads finish a barrier, so that they let go of the callbacks of past all-reduces
    (PowerSGD's hold the process group). Otherwise the last reference to the process group can go on one of gloo's
    own threads, whose destructor then joins itself, and the process aborts at exit ("Resource deadlock
    avoided")."""
    for holder in holders:
        holder.clear()
    gc.collect()
    for _ in range(2):
        dist.barrier()
    gc.collect()


def flat_grad(model: nn.Module) -> torch.Tensor:
    """Every parameter's gradient, flattened into one vector (zeros where a gradient is missing)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def local_gradient(reference: nn.Module, weights: dict, batch: tuple) -> torch.Tensor:
    """This rank's own flat gradient: `reference` takes `weights` and runs `batch` (no communication)."""
    reference.load_state_dict(weights)
    reference.zero_grad(set_to_none=True)
    images, labels = batch
    nn.functional.cross_entropy(reference(images), labels).backward()
    return flat_grad(reference)


def average(gradient: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """The exact average of `gradient` over the ranks of `group` (None: every rank): one float32 all-reduce of a
    copy, outside any hook, divided by the group's size."""
    summed = gradient.clone()
    dist.all_reduce(summed, group=group)
    return summed / dist.get_world_size(group)


def exact_average(reference: nn.Module, weights: dict, batch: tuple, group: dist.ProcessGroup | None = None
                  ) -> torch.Tensor:
    """The gradient an uncompressed all-reduce gives: the ranks' own gradients at `weights` on their `batch`,
    averaged over `group` (local_gradient, then average)."""
    return average(local_gradient(reference, weights, batch), group)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """||got - exact|| / ||exact||."""
    return ((got - exact).norm() / exact.norm()).item()


def fit_residual(got: torch.Tensor, target: torch.Tensor) -> float:
    """How far `got` is from any multiple of `target`: ||got - c target|| / ||got|| for the best c (0: `got` is
    `target` scaled; 1: nothing of `target` in it)."""
    if got.norm() == 0 or target.norm() == 0:
        return 1.0
    scale = torch.dot(got, target) / torch.dot(target, target)
    return ((got - scale * target).norm() / got.norm()).item()


def synchronize(device: torch.device) -> None:
    """Wait for the GPU's queued work before a clock is read (CUDA runs kernels after the call returns); a no-op on
    the CPU, where every operation has finished when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
