"""Our rebuild of DataParallel's algorithm on CPU (taught in lesson 03). Worker kit.

    from helpers.kit.dp_vs_ddp import NaiveDataParallel
    naive = NaiveDataParallel(model, num_devices=2)
    report = naive.train_step(images, labels, loss_fn, optimizer)   # report.phase_seconds, report.per_device

`nn.DataParallel` needs GPUs: on CPU it is a pass-through, and in torch 2.14.1 none of torch.nn.parallel's
four functions runs on a machine without a GPU. replicate and gather refuse CPU tensors: Broadcast.forward
(_functions.py:13-14), Gather.forward (_functions.py:85-86). scatter and parallel_apply stop because there is
no GPU: scatter takes a CPU input by design and ends in comm.scatter (comm.py:209, a device index, then
_C._scatter), parallel_apply asks for an accelerator (parallel_apply.py:71-73).
So NaiveDataParallel is OUR rebuild of DataParallel's algorithm on CPU "devices" (one thread and one set of
weights per device). Only its replicate step is torch's own code: torch.nn.parallel.replicate, with its
device copy (_broadcast_coalesced_reshape) swapped for our CPU Broadcast below. scatter, parallel_apply,
gather, the Broadcast and the split of the backward are ours.
The gradients reach the module's own parameters through Broadcast's backward, which sums them over the devices.
"""
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from unittest import mock

import torch
from torch import nn

from helpers.kit.tensors import own_bytes

PHASES = ("scatter", "replicate", "forward", "gather", "loss", "backward", "reduce", "step")


def scatter(batch: torch.Tensor, num_devices: int) -> list[torch.Tensor]:
    """Step 1, ours: split the batch along dim 0, one chunk per device. These are views in the same RAM: no copy,
    where torch's scatter copies each chunk to its GPU."""
    return list(torch.chunk(batch, num_devices))


class Broadcast(torch.autograd.Function):
    """CPU twin of torch.nn.parallel._functions.Broadcast: weights out to every device, gradients summed back.

    forward: device 0 gets the parameters themselves (torch/csrc/cuda/comm.cpp broadcast_coalesced:
    `outputs[0] = tensors`), every other device a copy. backward: the sum over devices of each parameter's
    gradient, which torch does with ReduceAddCoalesced -> comm.reduce_add_coalesced onto device 0.
    `log` (a dict) records what the backward did, so a lesson can show it.
    """

    @staticmethod
    def forward(ctx, log: dict, num_devices: int, *params: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.log, ctx.num_devices, ctx.num_params = log, num_devices, len(params)
        copies = [p.clone() for _ in range(num_devices - 1) for p in params]
        log["bytes_copied"] = own_bytes(copies)
        return (*params, *copies)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        k = ctx.num_params
        per_device = [grads[d * k:(d + 1) * k] for d in range(ctx.num_devices)]
        summed = [torch.stack(same_param).sum(0) for same_param in zip(*per_device, strict=True)]
        ctx.log.update(reduce_thread=threading.current_thread().name, reduce_calls=ctx.log.get("reduce_calls", 0) + 1,
                       devices_summed=len(per_device), bytes_from_other_devices=own_bytes(grads[k:]))
        return (None, None, *summed)


def _broadcast(tensors: Sequence[torch.Tensor], num_devices: int, log: dict | None = None) -> list[list]:
    """Broadcast.apply, its outputs cut into one list per device."""
    flat = Broadcast.apply({} if log is None else log, num_devices, *tensors)
    return [list(flat[d * len(tensors):(d + 1) * len(tensors)]) for d in range(num_devices)]


def replicate(module: nn.Module, num_devices: int, log: dict | None = None) -> tuple[list[nn.Module], list[list]]:
    """Step 2: one replica per device, made again every iteration, the way torch/nn/parallel/replicate.py does.

    Each replica module comes from torch's own Module._replicate_for_data_parallel (it has no parameters of
    its own); its weights are Broadcast's outputs, set as plain attributes: non-leaf tensors with no .grad.
    Ours, shown for reading: it skips buffers, which torch's replicate broadcasts every iteration
    (replicate.py:138-153). NaiveDataParallel uses torch's own replicate (torch_replicate_on_cpu).
    Returns the replicas and their weights.
    """
    params = list(module.parameters())
    weights = _broadcast(params, num_devices, log)
    index = {p: i for i, p in enumerate(params)}
    replicas = []
    for device in range(num_devices):
        copies = {m: m._replicate_for_data_parallel() for m in module.modules()}
        for original, replica in copies.items():
            for name, child in original._modules.items():
                setattr(replica, name, None if child is None else copies[child])
            for name, param in original._parameters.items():
                setattr(replica, name, None if param is None else weights[device][index[param]])
        replicas.append(copies[module])
    return replicas, weights


def torch_replicate_on_cpu(module: nn.Module, num_devices: int, log: dict | None = None,
                           weights: list | None = None) -> list[nn.Module]:
    """torch.nn.parallel.replicate itself, run on CPU: only its device copy is swapped for our Broadcast above.

    replicate() moves tensors with _broadcast_coalesced_reshape (torch's Broadcast, GPUs only); every other line
    that runs is torch's own, buffers included. Devices are given as indices, which replicate() accepts without
    a GPU. If `weights` is a list, the parameters' copies (one list per device) are appended to it.
    """
    calls: list[int] = []

    def broadcast_on_cpu(tensors, devices, detach=False):
        parameters = not calls  # replicate() broadcasts the parameters first (replicate.py:136), then buffers
        calls.append(len(tensors))
        copies = _broadcast(tensors, len(devices), log if parameters else None) if tensors else []
        if parameters and weights is not None:
            weights.extend(copies)
        return [[t.detach() for t in device] for device in copies] if detach else copies

    replicate_py = sys.modules["torch.nn.parallel.replicate"]  # the module; torch.nn.parallel.replicate is the function
    with mock.patch.object(replicate_py, "_broadcast_coalesced_reshape", broadcast_on_cpu):
        return torch.nn.parallel.replicate(module, list(range(num_devices)))


def parallel_apply(function: Callable[[int], None], num_devices: int, parallel: bool = True) -> None:
    """Ours: run function(device) for every device, one thread each, in ONE process, as torch's parallel_apply does
    on GPUs (torch's refuses to run without an accelerator: parallel_apply.py:70-73)."""
    if not parallel:
        for device in range(num_devices):
            function(device)
        return
    threads = [threading.Thread(target=function, args=(device,), name=f"our thread for device {device}")
               for device in range(num_devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def gather(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Step 4, ours: concatenate the outputs on device 0, where the loss is computed (its backward splits the grad).
    A torch.cat in the same RAM, where torch's gather copies every output to device 0."""
    return torch.cat(list(outputs))


def _nodes_until(node, stop: type) -> list:
    """The autograd nodes reachable from `node`, not going past nodes of autograd Function `stop`."""
    seen, todo = [], [node]
    while todo:
        current = todo.pop()
        if current is None or current in seen or type(current) is stop._backward_cls:
            continue
        seen.append(current)
        todo += [child for child, _ in current.next_functions]
    return seen


@dataclass
class StepReport:
    """What one NaiveDataParallel iteration did: its loss, the time of each phase, the evidence per device."""

    loss: float
    phase_seconds: dict[str, float]
    per_device: list[dict[str, float | str]] = field(default_factory=list)
    reduce: dict = field(default_factory=dict)


class NaiveDataParallel:
    """DataParallel's algorithm, readable and runnable on CPU: devices are threads and sets of weights.

    Torch runs the whole backward as one loss.backward(): the autograd engine gives every GPU its own
    thread, so each replica's backward runs on its device's thread, then Broadcast's backward sums the
    gradients. The CPU engine has no per-device threads, so train_step splits that backward in three
    calls: loss -> outputs (main thread), outputs -> replica weights (one thread per device), replica
    weights -> the module's parameters through Broadcast's backward (the reduction).
    parallel=False runs the devices one after another (to see what the threads buy, or not, under the GIL).
    evidence=False skips the hooks and the before/after reading of the weights (for timing whole steps).
    """

    def __init__(self, module: nn.Module, num_devices: int = 2, parallel: bool = True, evidence: bool = True) -> None:
        self.module, self.num_devices, self.parallel, self.evidence = module, num_devices, parallel, evidence

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   optimizer: torch.optim.Optimizer) -> StepReport:
        """One iteration: scatter, replicate, parallel forward, gather, loss, parallel backward, reduce, step."""
        n, clock, seconds, log = self.num_devices, time.perf_counter, {}, {}
        work: list[dict] = [{"samples": 0.0, "hooks_fired": 0} for _ in range(n)]
        t0 = start = clock()
        chunks = scatter(inputs, n)
        seconds["scatter"], start = clock() - start, clock()
        weights: list[list[torch.Tensor]] = []
        replicas = torch_replicate_on_cpu(self.module, n, log, weights)  # torch's replicate, our CPU Broadcast
        seconds["replicate"], start = clock() - start, clock()

        outputs: list = [None] * n

        def forward(device: int) -> None:
            outputs[device] = replicas[device](chunks[device])
            work[device]["samples"] = float(len(chunks[device]))

        parallel_apply(forward, n, self.parallel)
        seconds["forward"], start = clock() - start, clock()
        gathered = gather(outputs)
        seconds["gather"], start = clock() - start, clock()
        loss = loss_fn(gathered, targets)
        output_grads = torch.autograd.grad(loss, outputs)  # gather's backward: the gradient split per device
        seconds["loss"], start = clock() - start, clock()

        for device in range(n if self.evidence else 0):  # a hook on each replica's backward nodes: where, when
            for node in _nodes_until(outputs[device].grad_fn, Broadcast):
                node.register_hook(self._hook(work[device], t0))
        grads: list = [None] * n

        def backward(device: int) -> None:
            work[device]["backward_began_s"] = clock() - t0
            grads[device] = torch.autograd.grad(outputs[device], weights[device], output_grads[device])
            work[device]["backward_ended_s"] = clock() - t0

        parallel_apply(backward, n, self.parallel)
        seconds["backward"], start = clock() - start, clock()
        # The reduction: autograd runs Broadcast's backward with every device's gradients at once.
        torch.autograd.backward([w for ws in weights for w in ws], [g for gs in grads for g in gs])
        seconds["reduce"], start = clock() - start, clock()
        if self.evidence:
            self._structure(work, replicas, weights, grads, optimizer)
            before = [[w.detach().clone() for w in ws] for ws in weights]
        start = clock()
        optimizer.step()
        seconds["step"] = clock() - start
        if self.evidence:
            self._after_step(work, weights, before, optimizer)
        return StepReport(loss=loss.item(), phase_seconds=seconds, per_device=work, reduce=log)

    @staticmethod
    def _hook(record: dict, t0: float) -> Callable:
        def hook(grad_inputs, grad_outputs) -> None:
            now = time.perf_counter() - t0
            record["hooks_fired"] += 1
            record.setdefault("hook_threads", set()).add(threading.current_thread().name)
            record["first_hook_s"] = min(record.get("first_hook_s", now), now)
            record["last_hook_s"] = max(record.get("last_hook_s", now), now)
        return hook

    @staticmethod
    def _structure(work: list[dict], replicas: list[nn.Module], weights: list[list[torch.Tensor]],
                   grads: list, optimizer: torch.optim.Optimizer) -> None:
        """Read from the run, before the step: what each device's weights are, what the optimizer holds."""
        held = {p.untyped_storage().data_ptr() for group in optimizer.param_groups for p in group["params"]}
        for device, record in enumerate(work):
            with warnings.catch_warnings():  # reading .grad of a non-leaf warns; that it is None is the point
                warnings.simplefilter("ignore")
                record["weights_with_grad"] = sum(w.grad is not None for w in weights[device])
            record["weights_are_leaves"] = sum(w.is_leaf for w in weights[device])
            record["weight_grad_fn"] = type(weights[device][0].grad_fn).__name__
            record["replica_parameters"] = len(list(replicas[device].parameters()))
            record["weight_bytes"] = own_bytes(weights[device])
            record["grad_bytes_computed"] = own_bytes(grads[device])
            record["storages"] = {w.untyped_storage().data_ptr() for w in weights[device]}
            record["optimizer_holds"] = len(record["storages"] & held)

    @staticmethod
    def _after_step(work: list[dict], weights: list[list[torch.Tensor]], before: list[list[torch.Tensor]],
                    optimizer: torch.optim.Optimizer) -> None:
        """Read from the run, after the step: whose weights it changed, whose memory holds its state."""
        state = {p.untyped_storage().data_ptr(): s for p, s in optimizer.state.items()}
        for device, record in enumerate(work):
            storages = record.pop("storages")
            record["optimizer_state_bytes"] = sum(own_bytes([t for t in state[ptr].values() if torch.is_tensor(t)])
                                                  for ptr in storages & set(state))
            record["weights_changed_by_step"] = sum(not torch.equal(b, w.detach())
                                                    for b, w in zip(before[device], weights[device], strict=True))
