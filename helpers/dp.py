"""DataParallel opened up, and a DDP comm hook that counts all-reduce calls (taught in lesson 03).

    from helpers.dp import NaiveDataParallel, AllreduceCounter, counting_allreduce_hook
    dp = NaiveDataParallel(model, num_devices=2)
    report = dp.train_step(images, labels, loss_fn, optimizer)   # report.phase_seconds, report.per_device

    counter = AllreduceCounter()
    ddp.register_comm_hook(counter, counting_allreduce_hook)   # counter.calls, counter.bucket_numels

`nn.DataParallel` needs GPUs; NaiveDataParallel runs the same algorithm on CPU "devices" (one
thread and one model copy per device), step by step, so each step can be timed and inspected.
"""
import copy
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

PHASES = ("scatter", "replicate", "forward", "gather", "loss", "backward", "reduce", "step")


# ---------------------------------------------------------------------------- DP's steps, one function each

def scatter(batch: torch.Tensor, num_devices: int) -> list[torch.Tensor]:
    """Step 1: split the batch along dim 0, one chunk per device (DP copies each chunk to its GPU)."""
    return list(torch.chunk(batch, num_devices))


def replicate(module: nn.Module, num_devices: int) -> list[nn.Module]:
    """Step 2: a copy of the model per device, made again every iteration (DP broadcasts the weights).

    Device 0's replica is the module itself, as in DataParallel, where the broadcast to the first
    device returns the original tensors.
    """
    copies = [module]
    for _ in range(num_devices - 1):
        replica = copy.deepcopy(module)
        for parameter in replica.parameters():
            parameter.grad = None
        copies.append(replica)
    return copies


def parallel_apply(function: Callable[[int], None], num_devices: int, parallel: bool = True) -> None:
    """Run function(device) for every device, in one thread each (DP's threads in ONE process)."""
    if not parallel:
        for device in range(num_devices):
            function(device)
        return
    threads = [threading.Thread(target=function, args=(device,)) for device in range(num_devices)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def gather(outputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Step 4: concatenate the outputs on device 0, where the loss is computed."""
    return torch.cat(list(outputs))


def reduce_gradients(replicas: Sequence[nn.Module]) -> None:
    """After backward: add every replica's gradients onto device 0's (the module's) gradients."""
    first, *others = replicas
    for parameters in zip(first.parameters(), *(r.parameters() for r in others), strict=True):
        target, *sources = parameters
        for source in sources:
            target.grad += source.grad


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@dataclass
class StepReport:
    """What one NaiveDataParallel iteration did: its loss, the time of each phase, the work per device."""

    loss: float
    phase_seconds: dict[str, float]
    per_device: list[dict[str, float]] = field(default_factory=list)


class NaiveDataParallel:
    """DataParallel's algorithm, readable and runnable on CPU: devices are threads and model copies.

    parallel=False runs the devices one after another (to see what the threads buy, or not, under the GIL).
    """

    def __init__(self, module: nn.Module, num_devices: int = 2, parallel: bool = True) -> None:
        self.module, self.num_devices, self.parallel = module, num_devices, parallel

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                   optimizer: torch.optim.Optimizer) -> StepReport:
        """One iteration: scatter, replicate, parallel forward, gather, loss, parallel backward, reduce, step."""
        n, clock, seconds = self.num_devices, time.perf_counter, {}
        work = [{"samples": 0.0, "forward_cpu_s": 0.0, "backward_cpu_s": 0.0} for _ in range(n)]

        start = clock()
        chunks = scatter(inputs, n)
        seconds["scatter"], start = clock() - start, clock()
        replicas = replicate(self.module, n)
        seconds["replicate"], start = clock() - start, clock()

        outputs: list[torch.Tensor | None] = [None] * n

        def forward(device: int) -> None:
            began = time.thread_time()  # CPU time of this device's thread only
            outputs[device] = replicas[device](chunks[device])
            work[device]["samples"] = float(len(chunks[device]))
            work[device]["forward_cpu_s"] = time.thread_time() - began

        parallel_apply(forward, n, self.parallel)
        seconds["forward"], start = clock() - start, clock()
        # The gathered copy is a new leaf: its gradient is what DP scatters back to the devices.
        gathered = gather([o.detach() for o in outputs]).requires_grad_()
        seconds["gather"], start = clock() - start, clock()
        loss = loss_fn(gathered, targets)
        loss.backward()
        output_grads = scatter(gathered.grad, n)
        seconds["loss"], start = clock() - start, clock()

        def backward(device: int) -> None:
            began = time.thread_time()
            outputs[device].backward(output_grads[device])
            work[device]["backward_cpu_s"] = time.thread_time() - began

        parallel_apply(backward, n, self.parallel)
        seconds["backward"], start = clock() - start, clock()
        for device, replica in enumerate(replicas):
            work[device]["grad_norm_before_reduce"] = float(
                torch.norm(torch.stack([p.grad.norm() for p in replica.parameters()])))
        reduce_gradients(replicas)
        seconds["reduce"], start = clock() - start, clock()
        optimizer.step()
        seconds["step"] = clock() - start

        self._account_memory(work, replicas, outputs, gathered, optimizer)
        return StepReport(loss=loss.item(), phase_seconds=seconds, per_device=work)

    def _account_memory(self, work: list[dict], replicas: Sequence[nn.Module], outputs: Sequence[torch.Tensor],
                        gathered: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Bytes of the tensors each device holds at the end of the iteration (activations not counted)."""
        state = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        for device, replica in enumerate(replicas):
            params = list(replica.parameters())
            work[device]["param_bytes"] = _nbytes(params)
            work[device]["grad_bytes"] = _nbytes([p.grad for p in params])
            work[device]["output_bytes"] = _nbytes([outputs[device]]) + (_nbytes([gathered]) if device == 0 else 0)
            work[device]["optimizer_state_bytes"] = _nbytes(state) if device == 0 else 0
            work[device]["optimizer_steps"] = 1 if device == 0 else 0


def single_device_gradients(module: nn.Module, inputs: torch.Tensor, targets: torch.Tensor,
                            loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """The reference: plain forward/backward of the whole batch on one copy of the model."""
    reference = copy.deepcopy(module)
    reference.zero_grad(set_to_none=True)
    loss_fn(reference(inputs), targets).backward()
    return [p.grad.clone() for p in reference.parameters()]


def max_abs_diff(first: Sequence[torch.Tensor], second: Sequence[torch.Tensor]) -> float:
    """The largest elementwise difference between two lists of tensors."""
    return max(float((a - b).detach().abs().max()) for a, b in zip(first, second, strict=True))


def check_reduce(reduce: Callable[[Sequence[nn.Module]], None]) -> bool:
    """The exercise's check: does `reduce(replicas)` leave the summed gradients on replicas[0]?"""
    torch.manual_seed(0)
    replicas = [nn.Linear(3, 2) for _ in range(3)]
    for replica in replicas:
        replica(torch.randn(4, 3)).pow(2).sum().backward()
    expected = [sum(r.weight.grad for r in replicas), sum(r.bias.grad for r in replicas)]
    others_before = [p.grad.clone() for r in replicas[1:] for p in r.parameters()]
    try:
        reduce(replicas)
    except NotImplementedError:
        print("Not yet: reduce_onto_first still raises NotImplementedError. Write its body.")
        return False
    got = [replicas[0].weight.grad, replicas[0].bias.grad]
    if any(g is None for g in got) or max_abs_diff(got, expected) > 1e-6:
        print("Not yet: replicas[0] should hold the SUM of every replica's gradients (its own included).")
        return False
    if max_abs_diff([p.grad for r in replicas[1:] for p in r.parameters()], others_before) > 0:
        print("Not yet: only device 0's gradients should change; the other replicas are thrown away.")
        return False
    print("Correct: device 0 now holds the sum of every replica's gradients, as DataParallel does.")
    return True


# ---------------------------------------------------------------------------- DDP: counting all-reduce calls

def deep_mlp(depth: int = 16, width: int = 256, classes: int = 10) -> nn.Module:
    """A model with many equal layers, so that gradient buckets have something to split."""
    layers: list[nn.Module] = [nn.Flatten(), nn.Linear(28 * 28, width), nn.ReLU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, classes))
    return nn.Sequential(*layers)


class AllreduceCounter:
    """State for counting_allreduce_hook: how many all-reduce calls DDP made, and their sizes."""

    def __init__(self, process_group: dist.ProcessGroup | None = None) -> None:
        self.process_group = process_group
        self.calls = 0
        self.bucket_numels: list[int] = []
        self.launch_times: list[float] = []

    def reset(self) -> None:
        self.calls, self.bucket_numels, self.launch_times = 0, [], []


def counting_allreduce_hook(state: AllreduceCounter, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's default all-reduce (average over ranks), with one count per call: one call per bucket.

    The return annotation must be spelled out: DDP checks it when the hook is registered.
    """
    state.calls += 1
    state.bucket_numels.append(bucket.buffer().numel())
    state.launch_times.append(time.perf_counter())
    return default_hooks.allreduce_hook(state.process_group, bucket)


def median_seconds(step: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall-clock seconds of step() (after warm-up calls), synchronising CUDA if it is in use."""
    for _ in range(warmup):
        step()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return sorted(seconds)[len(seconds) // 2]


def data_parallel_step_ms(model: nn.Module, global_batch: int = 64, repeats: int = 5) -> float:
    """Milliseconds per training step of nn.DataParallel(model) on every visible GPU (CPU: pass-through)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    wrapped = nn.DataParallel(model.to(device))
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    images = torch.rand(global_batch, 1, 28, 28, device=device)
    labels = torch.randint(0, 10, (global_batch,), device=device)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(wrapped(images), labels).backward()
        optimizer.step()

    return 1000 * median_seconds(step, repeats)
