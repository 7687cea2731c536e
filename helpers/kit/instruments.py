"""Instruments that workers put into a training step to measure what torch does. Worker kit.

    from helpers.kit.instruments import AllreduceCounter, counting_allreduce_hook      # lesson 03
    ddp.register_comm_hook(counter, counting_allreduce_hook)   # counter.calls, counter.bucket_numels
    with SavedActivations(model) as saved: loss = model(x).sum()                 # lesson 07
    saved.bytes, saved.peak                                     # what autograd kept for backward
    Stopwatch(stage), SimulatedWork(ms_per_sample)              # lesson 07's pipeline timelines
    diverged_tensors(model), nonfinite_ranks(loss)              # lesson 08's cross-rank checks

No `from __future__ import annotations` here: DDP checks a comm hook's annotations when it is registered,
so they must be real types.
"""
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from helpers.kit.tensors import checksums, local_shard


class WrappedWork(dist.Work):
    """torch's Work of an async call, standing in for it: is_completed, is_success, exception and result ask the real
    one; a subclass changes wait() (and what else it must). Ours: the checks that record or hold an async call's
    result (lesson 09's CommLog, lesson 12's HeldReceives) hand this back instead of torch's Work."""

    def __init__(self, work: dist.Work) -> None:
        super().__init__()
        self.work = work

    def wait(self, timeout=None) -> bool:
        return self.work.wait() if timeout is None else self.work.wait(timeout)

    def is_completed(self) -> bool:
        return self.work.is_completed()

    def is_success(self) -> bool:
        return self.work.is_success()

    def exception(self):
        return self.work.exception()

    def result(self):
        return self.work.result()


class AllreduceCounter:
    """State for counting_allreduce_hook: how many all-reduces DDP launched (one per gradient bucket) and each
    bucket's number of elements.

    Ours, through DDP's comm-hook API, rather than torch's CommDebugMode: CommDebugMode sees DDP's all-reduce too
    (as c10d.allreduce_), but it keeps a count per op, and shapes only of DTensor arguments
    (torch/distributed/tensor/debug/_comm_mode.py:677-706), not the size of each bucket, which lesson 03 measures."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.calls = 0
        self.bucket_numels: list[int] = []

    def reset(self) -> None:
        self.calls, self.bucket_numels = 0, []


def counting_allreduce_hook(state: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (average over ranks), with one count per call: one call per bucket.

    The annotations must be real types (no `from __future__ import annotations` in this file): DDP checks
    them when the hook is registered.
    """
    state.calls += 1
    state.bucket_numels.append(bucket.buffer().numel())
    return default_hooks.allreduce_hook(state.process_group, bucket)


class _Saved:
    """What autograd stores instead of a saved tensor while SavedActivations is on: it knows when it is freed."""

    def __init__(self, tensor: torch.Tensor, key: tuple, counter: "SavedActivations") -> None:
        self.tensor, self.key, self.counter = tensor, key, counter

    def __del__(self) -> None:
        self.counter._release(self.key)


class SavedActivations:
    """Counts the bytes autograd saves for backward while `model` runs (its weights left out).

    `bytes`: everything saved while the context was on. `live`/`peak`: what is saved and not yet freed,
    now and at most (autograd drops saved tensors once the backward that needs them has run). Counted with
    `torch.autograd.graph.saved_tensors_hooks`, which sees every tensor autograd saves outside a
    `torch.utils.checkpoint` region (inside one, the checkpoint's own hooks take over; the tensors that selective
    activation checkpointing saves bypass these hooks in torch 2.14.1 unless checkpoint() gets
    respect_saved_tensors_hooks=True, torch/utils/checkpoint.py:554-566; a custom autograd.Function that keeps a
    tensor as a plain ctx attribute instead of ctx.save_for_backward is not seen either). The hooks are not tied
    to `model`: they
    see every tensor autograd saves while the context is on, so a loss computed inside it is counted too (in this
    lesson's pipeline worker, torch's schedule computes the loss on stage 1 inside the context; `model` only tells
    which saved tensors are its weights, left out).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.bytes = self.live = self.peak = 0
        self._held: dict[tuple, list[int]] = {}  # key -> [times saved and not freed, bytes]

    def _pack(self, tensor: torch.Tensor) -> Any:
        # Looked up now: FSDP swaps in gathered (unsharded) weights only while a layer runs.
        weights = {local_shard(p).untyped_storage().data_ptr() for p in self.model.parameters()}
        if tensor.untyped_storage().data_ptr() in weights:
            return tensor
        # A tensor saved twice (a ReLU output is also the next Linear's input) is held once.
        key = (tensor.data_ptr(), tensor.numel(), tensor.element_size())
        if key not in self._held:
            size = tensor.numel() * tensor.element_size()
            self._held[key] = [0, size]
            self.bytes += size
            self.live += size
            self.peak = max(self.peak, self.live)
        self._held[key][0] += 1
        return _Saved(tensor, key, self)

    def _release(self, key: tuple) -> None:
        entry = self._held[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._held[key]

    @staticmethod
    def _unpack(saved: Any) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class _Sleep(torch.autograd.Function):
    """Identity that takes `seconds` in forward and again in backward, like a stage with fixed compute."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, seconds: float) -> torch.Tensor:
        ctx.seconds = seconds
        time.sleep(seconds)
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


class SimulatedWork(nn.Module):
    """Adds `ms_per_sample` x batch milliseconds to a stage's forward and to its backward (none if 0).

    On a 2-core CPU a stage of a small MLP computes a micro-batch in about a millisecond, and the time a
    pipeline step spends outside the stages' compute (hand-overs, waiting for a core, the schedule's Python)
    varies with the load and can be as large; lesson 07 section 4 prints both. Sleeping makes the stage time
    known and lets two processes share two busy cores without slowing each other.
    """

    def __init__(self, ms_per_sample: float) -> None:
        super().__init__()
        self.ms_per_sample = ms_per_sample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ms_per_sample == 0:
            return x
        return _Sleep.apply(x, self.ms_per_sample * x.shape[0] / 1e3)


class _Mark(torch.autograd.Function):
    """Identity that records the time when the forward and the backward pass through it."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, watch: "Stopwatch", name: str) -> torch.Tensor:
        ctx.watch, ctx.name = watch, name
        watch.times.append((f"forward {name}", time.time()))
        watch.cpu_times.append(time.thread_time())
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.watch.times.append((f"backward {ctx.name}", time.time()))
        ctx.watch.cpu_times.append(time.thread_time())
        return grad, None, None


class Stopwatch(nn.Module):
    """Wraps a stage so that every forward and backward through it becomes a (kind, start, end) interval.

    Beside the wall clock it reads this thread's CPU clock (`time.thread_time`) at the same marks: on CPU the
    stage's forward and backward run on the calling thread, so an interval whose wall time exceeds its CPU
    time spent part of it waiting (for a core, with OMP_NUM_THREADS=1 per process).
    """

    def __init__(self, stage: nn.Module) -> None:
        super().__init__()
        self.stage = stage
        self.times: list[tuple[str, float]] = []
        self.cpu_times: list[float] = []
        self._input_marked = True
        # The first stage gets plain data, which needs no gradient (torch's PipelineStage passes it as it is).
        # Its backward ends when the gradients of all its parameters are computed: a multi-grad hook notes that
        # moment, so the stage computes no input gradient that torch would not.
        trained = [p for p in stage.parameters() if p.requires_grad]
        if trained:
            torch.autograd.graph.register_multi_grad_hook(trained, self._parameters_done)

    def _note(self, label: str) -> None:
        self.times.append((label, time.time()))
        self.cpu_times.append(time.thread_time())

    def _parameters_done(self, _grads: Any) -> None:
        if not self._input_marked:  # a stage whose input has a gradient marks its backward's end there
            self._note("backward start")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._input_marked = x.requires_grad
        if self._input_marked:
            x = _Mark.apply(x, self, "start")
        else:
            self._note("forward start")
        return _Mark.apply(self.stage(x), self, "end")

    def intervals(self) -> list[tuple[str, float, float]]:
        """Forward runs from 'start' to 'end'; backward runs back from 'end' to 'start'."""
        intervals, opened = [], {}
        for label, moment in self.times:
            kind, mark = label.split()
            if (kind, mark) in (("forward", "start"), ("backward", "end")):
                opened.setdefault(kind, []).append(moment)
            else:
                intervals.append((kind, opened[kind].pop(0), moment))
        return intervals

    def cpu_seconds(self) -> list[float]:
        """This thread's CPU seconds inside each interval, in the order of `intervals()`."""
        spent, opened = [], {}
        for (label, _), moment in zip(self.times, self.cpu_times, strict=True):
            kind, mark = label.split()
            if (kind, mark) in (("forward", "start"), ("backward", "end")):
                opened.setdefault(kind, []).append(moment)
            else:
                spent.append(moment - opened[kind].pop(0))
        return spent

    def clear(self) -> None:
        """Forget the marks of earlier steps."""
        self.times.clear()
        self.cpu_times.clear()


def diverged_tensors(model: Any, tolerance: float = 0.0) -> list[str]:
    """Names of the model's parameters and buffers whose checksum is not the same on every rank.

    One all_gather of len(state_dict) numbers: cheap enough to run every few steps of a real job.
    """
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    local = checksums(named)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    spread = torch.stack(gathered).amax(0) - torch.stack(gathered).amin(0)
    return [name for name, gap in zip(named, spread.tolist(), strict=True) if gap > tolerance]


def nonfinite_ranks(value: Any) -> list[int]:
    """The ranks whose `value` (a tensor, e.g. the local loss) holds a NaN or an inf. Call on every rank."""
    flags = torch.zeros(dist.get_world_size())
    flags[dist.get_rank()] = float(not torch.isfinite(value.detach()).all())
    dist.all_reduce(flags)  # each rank fills its own slot; the sum is everyone's flags
    return [rank for rank, flag in enumerate(flags.tolist()) if flag]
