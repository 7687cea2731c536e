"""Mixed precision in small, checkable pieces (taught in notebooks/04_amp.ipynb).

    from helpers.lessons.amp import format_facts, plot_formats, gradients_of, underflow_fraction
    from helpers.lessons.amp import layer_dtypes, op_dtypes, check_amp_train_step

Number formats, the gradients that fp16 loses, which ops autocast lowers, and the check for the
lesson's exercise. The training runs themselves are worker scripts (helpers/workers/amp_*.py).
"""
from __future__ import annotations

import copy
import gc
import re
import weakref
from collections.abc import Callable
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn
from torch.nn import functional as F

from helpers.lessons.checks import correct, not_yet, your_line
from helpers.lessons.plots import FIGSIZE

FORMATS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def format_facts() -> dict[str, dict[str, float | int]]:
    """Bits, range and precision of fp32, fp16 and bf16, from torch.finfo (mantissa bits: eps = 2^-mantissa)."""
    facts = {}
    for name, dtype in FORMATS.items():
        info = torch.finfo(dtype)
        mantissa_bits = -int(torch.log2(torch.tensor(info.eps, dtype=torch.float64)).item())
        facts[name] = {
            "bits": info.bits,
            "exponent bits": info.bits - 1 - mantissa_bits,
            "mantissa bits": mantissa_bits,
            "largest": info.max,
            "smallest normal": info.tiny,
            "smallest subnormal": info.smallest_normal * 2.0 ** -mantissa_bits,
            "epsilon (gap after 1.0)": info.eps,
        }
    return facts


def plot_formats(ax: plt.Axes | None = None) -> plt.Axes:
    """Each format's range on a log axis: subnormals (thin), normal numbers (thick), and epsilon."""
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, dpi=80, layout="constrained")
    for row, fact in enumerate(format_facts().values()):
        low, normal, high = (torch.tensor(fact[k]).log10().item()
                             for k in ("smallest subnormal", "smallest normal", "largest"))
        ax.plot([low, normal], [row, row], lw=3, color=f"C{row}", alpha=0.5)
        ax.plot([normal, high], [row, row], lw=10, color=f"C{row}", solid_capstyle="butt")
        ax.text(high + 1, row, f"max {fact['largest']:.3g}, eps {fact['epsilon (gap after 1.0)']:.1g}",
                va="center", fontsize=9)
    ax.set_yticks(range(len(FORMATS)), list(FORMATS))
    ax.set(xlabel="log10 |value|", title="Representable magnitudes (thin = subnormal, less precise)",
           xlim=(-48, 60))
    ax.grid(axis="x", alpha=0.3)
    return ax


def train_briefly(epochs: int = 30, seed: int = 0, batch: int = 64) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The article's SimpleModel trained in fp32 on the lesson's digits: late-training gradients are small."""
    from helpers.kit.data import load
    from helpers.kit.models import SimpleModel

    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and robust on a busy machine
    images, labels = load(train=True)[0].tensors
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(epochs):
        for start in range(0, len(images), batch):
            loss = F.cross_entropy(model(images[start:start + batch]), labels[start:start + batch])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    torch.set_num_threads(threads)
    return model, images, labels


def gradients_of(model: nn.Module, images: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every non-zero gradient one fp32 backward pass computes: of the weights, and of each layer's output."""
    activation_grads: list[torch.Tensor] = []

    def keep_output_grad(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        output.register_hook(lambda grad: activation_grads.append(grad.detach().flatten()))

    handles = [m.register_forward_hook(keep_output_grad) for m in model.modules() if isinstance(m, nn.Linear)]
    model.zero_grad()
    F.cross_entropy(model(images), labels).backward()
    for handle in handles:
        handle.remove()
    grads = {"weight gradients": torch.cat([p.grad.flatten() for p in model.parameters()]),
             "activation gradients": torch.cat(activation_grads)}
    return {name: g[g != 0] for name, g in grads.items()}


def underflow_fraction(values: torch.Tensor, dtype: torch.dtype = torch.float16, scale: float = 1.0) -> float:
    """Fraction of non-zero fp32 values that become exactly 0 when multiplied by `scale` and cast to `dtype`."""
    values = values[values != 0]
    return ((values * scale).to(dtype) == 0).float().mean().item()


def largest_safe_scale(values: torch.Tensor, dtype: torch.dtype = torch.float16) -> float:
    """The largest power of two that keeps every scaled value finite in `dtype` (what GradScaler hunts for)."""
    exponent = torch.floor(torch.log2(torch.finfo(dtype).max / values.abs().max())).item()
    return 2.0 ** exponent


def plot_gradient_histogram(grads: torch.Tensor, scales: dict[str, float],
                            ax: plt.Axes | None = None) -> plt.Axes:
    """Histogram of log2|gradient| after each scale, with the fp16 limits drawn in."""
    if ax is None:
        _, ax = plt.subplots(figsize=FIGSIZE, dpi=80, layout="constrained")
    info = torch.finfo(torch.float16)
    for name, scale in scales.items():
        ax.hist(torch.log2(grads.abs() * scale).numpy(), bins=80, alpha=0.5, label=name)
    ax.axvline(-25, color="k", ls="--", lw=1)  # 2^-25, half the smallest subnormal 2^-24: at or below it, rounds to 0
    ax.axvline(torch.log2(torch.tensor(info.tiny)).item(), color="k", ls=":", lw=1,
               label="fp16 smallest normal, 2^-14")
    ax.axvline(torch.log2(torch.tensor(info.max)).item(), color="r", ls="--", lw=1)
    ax.text(-25.5, ax.get_ylim()[1] * 0.9, "fp16 zero below", ha="right", fontsize=8)
    ax.text(15.5, ax.get_ylim()[1] * 0.9, "fp16 inf above", fontsize=8, color="r")
    ax.set(xlabel="log2 |gradient|", ylabel="count", title="Gradients against fp16's range")
    ax.legend(loc="center left", fontsize=8)
    return ax


def layer_dtypes(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, device_type: str = "cpu",
                 dtype: torch.dtype = torch.bfloat16) -> list[tuple[str, str, str]]:
    """(layer, kind, output dtype) for every leaf layer and the loss, in one autocast forward pass."""
    seen: list[tuple[str, str, str]] = []

    def record(name: str) -> Callable:
        return lambda module, inputs, output: seen.append((name, type(module).__name__, str(output.dtype)))

    handles = [module.register_forward_hook(record(name)) for name, module in model.named_modules()
               if len(list(module.children())) == 0]
    with torch.autocast(device_type=device_type, dtype=dtype):
        loss = F.cross_entropy(model(images), labels)
    for handle in handles:
        handle.remove()
    return [*seen, ("loss", "cross_entropy", str(loss.dtype))]


def op_dtypes(device_type: str = "cpu", dtype: torch.dtype = torch.bfloat16) -> dict[str, str]:
    """Output dtype of single ops under autocast: which run lowered, which autocast sends back to fp32."""
    a, b = torch.rand(8, 8, device=device_type), torch.rand(8, 8, device=device_type)
    targets = torch.zeros(8, dtype=torch.long, device=device_type)
    with torch.autocast(device_type=device_type, dtype=dtype):
        low = a @ b  # a lowered tensor: the ops below show whether they keep it low or go back to fp32
        ops = {
            "matmul (a @ b)": low,
            "linear": F.linear(a, b),
            "relu": F.relu(low),
            "exp": torch.exp(low),
            "sum": low.sum(),
            "softmax": torch.softmax(low, dim=1),
            "log_softmax": F.log_softmax(low, dim=1),
            "layer_norm": F.layer_norm(low, (8,)),
            # both inputs lowered: an fp32 result is autocast's fp32 list at work, not type promotion
            "mse_loss(lowered, lowered)": F.mse_loss(low, low),
            "cross_entropy": F.cross_entropy(low, targets),
            "add lowered + fp32 (ordinary promotion)": low + a,
        }
        if device_type == "cpu":  # index_copy is on the CPU's promote list only (CUDA's list differs)
            # index_copy has no type promotion of its own: outside autocast, a bf16 self with an fp32 source
            # raises "expected to have the same dtype". Autocast's promote policy casts both to fp32 first.
            ops["index_copy(lowered, fp32) (autocast: promote)"] = torch.index_copy(low, 0, targets[:2], a[:2])
    return {name: str(out.dtype) for name, out in ops.items()}


def cuda_fp32_ops() -> set[str]:
    """The ops that CUDA autocast runs in fp32, read from the header torch installs (include/ATen/autocast_mode.h,
    macros AT_FORALL_FP32 and AT_FORALL_FP32_SET_OPT_DTYPE; aten/src/ATen/autocast_mode.cpp registers them for the
    CUDA autocast key). The CPU's lists are written out in autocast_mode.cpp itself, which is not installed."""
    text = (Path(torch.__file__).parent / "include" / "ATen" / "autocast_mode.h").read_text()
    ops: set[str] = set()
    for macro in ("AT_FORALL_FP32(_)", "AT_FORALL_FP32_SET_OPT_DTYPE(_)"):
        body = text[text.index(f"#define {macro}"):]
        ops |= set(re.findall(r"_\((\w+)", body[:body.index("\n\n")]))
    return ops


def overflows_under_autocast(device_type: str = "cpu", dtype: torch.dtype = torch.float16) -> dict[str, str]:
    """Two ops on a lowered tensor under autocast, each result's dtype and value: the sum of 100,000 ones, and
    exp(12). Both are far above fp16's largest value (65,504): in fp16 they are inf, in fp32 they are not."""
    ones, one = torch.ones(100_000, 1, device=device_type), torch.ones(1, 1, device=device_type)
    with torch.autocast(device_type, dtype=dtype):
        low = ones @ one  # 100,000 ones, in `dtype`
        results = {"sum of 100,000 ones": low.sum(), "exp(12)": torch.exp(low[0, 0] * 12)}
    return {name: f"{str(value.dtype).removeprefix('torch.')} {value.float().item():g}"
            for name, value in results.items()}


def sums_of_ones(count: int = 4096, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """`count` ones added up two ways in a 16-bit format: by torch's matmul kernel (a row of ones times a column of
    ones), and by a running total kept in that format, one addition at a time."""
    row, column = torch.ones(1, count, dtype=dtype), torch.ones(count, 1, dtype=dtype)
    running = torch.zeros((), dtype=dtype)
    for value in row[0]:
        running = running + value  # rounded to `dtype` after every addition
    return {"matmul kernel": (row @ column).item(), "running total in 16 bits": running.item()}


def mismatch_after_autocast() -> str:
    """A bf16 activation made under autocast, used by an fp32 layer after the block: torch's error message."""
    torch.manual_seed(0)
    body, head = nn.Linear(8, 8), nn.Linear(8, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = body(torch.rand(4, 8))  # bf16: autocast lowered the linear layer
    try:
        head(hidden)  # outside the block: a bf16 input meets fp32 weights, and nothing casts them
    except RuntimeError as error:
        return str(error)
    return "no error"


def cpu_16bit_support(flags: set[str]) -> list[str]:
    """What this CPU offers 16-bit training, in lines to print: its instructions, the kernels torch picks, and one
    sentence that reads them together (an AVX-512 CPU without bf16 instructions still gets oneDNN bf16 kernels,
    which convert to fp32 inside)."""
    listed = sorted(flags & {"avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16",
                             "f16c"})
    bf16_kernels = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    fp16_kernels = bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    bf16_in_hardware = bool(flags & {"avx512_bf16", "amx_bf16"})
    if bf16_kernels and bf16_in_hardware:
        bf16 = "bf16: oneDNN has bf16 kernels, and this CPU computes bf16 dot products in hardware"
    elif bf16_kernels:
        bf16 = ("bf16: oneDNN has bf16 kernels for this CPU although it lists no bf16 instructions: they convert "
                "bf16 to fp32 inside the kernel, which saves memory traffic but no arithmetic")
    else:
        bf16 = "bf16: no oneDNN bf16 kernels here: bf16 ops run on generic code, often slower than fp32"
    fp16 = ("fp16: oneDNN has fp16 kernels here" if fp16_kernels else
            "fp16: no oneDNN fp16 kernels here: torch runs fp16 convolutions on its own generic CPU code")
    return [f"vector and 16-bit instructions of this CPU: {listed or 'none listed'}",
            f"kernels torch dispatches to (torch.backends.cpu.get_cpu_capability()): "
            f"{torch.backends.cpu.get_cpu_capability()}",
            f"oneDNN bf16 kernels: {bf16_kernels} | oneDNN fp16 kernels: {fp16_kernels}", bf16, fp16]


def index_copy_without_autocast() -> str:
    """index_copy of an fp32 source into a bf16 tensor outside autocast: torch's error message, or the dtype."""
    low, a = torch.rand(8, 8).to(torch.bfloat16), torch.rand(8, 8)
    try:
        return str(torch.index_copy(low, 0, torch.tensor([0, 1]), a[:2]).dtype)
    except RuntimeError as error:
        return str(error)


def saved_tensor_bytes(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                       dtype: torch.dtype | None) -> dict[str, int]:
    """Bytes of the tensors autograd saves for backward in one forward pass, by kind and dtype.

    `dtype=None` runs in fp32 without autocast. torch.autograd.graph.saved_tensors_hooks sees every tensor an op
    saves; each storage is counted once (a ReLU output saved by two ops is one tensor in memory). The parameters
    themselves are left out (they exist with or without a forward pass), and so are views of them (a Linear
    layer saves its weight's transpose); a 16-bit cast of a parameter (a tensor made by ToCopyBackward0 from a
    leaf, or a view of one) is counted apart, as "16-bit weight casts". Keys: "activations <dtype>" and
    "16-bit weight casts"."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    sizes: dict[str, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        address = t.untyped_storage().data_ptr()
        if address in parameters or address in seen:
            return t
        seen.add(address)
        node = (t._base if t._base is not None else t).grad_fn  # a view (Linear saves weight.t()): its base's
        is_cast = (node is not None and type(node).__name__ == "ToCopyBackward0"
                   and any(type(n).__name__ == "AccumulateGrad" for n, _ in node.next_functions if n is not None))
        kind = "16-bit weight casts" if is_cast else f"activations {str(t.dtype).removeprefix('torch.')}"
        sizes[kind] = sizes.get(kind, 0) + t.nbytes  # the tensor's bytes (a batch may be a view of a bigger one)
        return t

    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
          torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None)):
        loss = F.cross_entropy(model(images), labels)
    del loss
    return dict(sorted(sizes.items()))


def parameter_bytes_at_end_of_forward(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                                      zero_grad_before_forward: bool, set_to_none: bool = True,
                                      dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Bytes per parameter alive at the end of the second forward pass of a bf16 autocast loop with Adam.

    Runs one full step (forward, zero_grad(set_to_none), backward, step), then the second step's forward pass, with
    zero_grad(set_to_none) either before that forward pass or (as the lesson's workers do) after it. Counts, at the end
    of that forward pass inside autocast: the fp32 weights, the .grad tensors that exist, Adam's state, and the 16-bit
    casts of the parameters still alive (cast_names_alive's method: weak references to what aten._to_copy made from a
    parameter)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    optimizer = torch.optim.Adam(model.parameters())
    count = sum(p.numel() for p in model.parameters())
    casts: list[weakref.ref] = []

    class KeepParameterCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter):
                casts.append(weakref.ref(out))
            return out

    lowered = dtype != torch.float32  # dtype=torch.float32: plain fp32 training, autocast off, for comparison
    with torch.autocast("cpu", dtype=dtype, enabled=lowered):
        loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad(set_to_none=set_to_none)
    loss.backward()
    optimizer.step()
    if zero_grad_before_forward:
        optimizer.zero_grad(set_to_none=set_to_none)
    with KeepParameterCasts(), torch.autocast("cpu", dtype=dtype, enabled=lowered):
        loss = F.cross_entropy(model(images), labels)
        gc.collect()
        cast_bytes = sum(t.untyped_storage().nbytes() for ref in casts if (t := ref()) is not None)
    held = bytes_per_parameter(model, optimizer)
    held["16-bit casts of the weights"] = cast_bytes / count
    if not zero_grad_before_forward:
        optimizer.zero_grad(set_to_none=set_to_none)  # where the workers call it: after the forward pass
    loss.backward()
    return held


def parameter_casts(contexts: int, passes_per_context: int, cache_enabled: bool = True) -> int:
    """How often autocast casts a Linear layer's fp32 weight and bias to bf16 over several forward passes.

    Counts the aten._to_copy calls whose input requires grad (the parameters, not the input batch)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountParameterCasts(TorchDispatchMode):
        casts = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].requires_grad:
                self.casts += 1
            return func(*args, **(kwargs or {}))

    layer, batch = nn.Linear(4, 4), torch.rand(2, 4)
    with CountParameterCasts() as counter:
        for _ in range(contexts):
            with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=cache_enabled):
                for _ in range(passes_per_context):
                    layer(batch)
    return counter.casts


def cast_bytes_alive(model: nn.Module, images: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> dict[str, float]:
    """Bytes per parameter held by autocast's 16-bit copies of the parameters, at three moments of one step.

    Keeps a weak reference to every tensor that aten._to_copy makes from an nn.Parameter (autocast's casts: the
    cache, aten/src/ATen/autocast_mode.cpp `cached_cast`, and what autograd saved of them), and sums the bytes
    of those still alive: at the end of the forward pass inside the context, after the context exits
    (torch.clear_autocast_cache() in autocast.__exit__, torch/amp/autocast_mode.py), and after backward."""
    count = sum(p.numel() for p in model.parameters())
    return {moment: sum(alive.values()) / count for moment, alive in cast_names_alive(model, images, dtype).items()}


def cast_names_alive(model: nn.Module, images: torch.Tensor,
                     dtype: torch.dtype = torch.bfloat16) -> dict[str, dict[str, int]]:
    """Like cast_bytes_alive, per parameter: {moment: {parameter name: bytes of its 16-bit casts still alive}}."""
    from torch.utils._python_dispatch import TorchDispatchMode

    names = {id(p): name for name, p in model.named_parameters()}
    casts: list[tuple[str, weakref.ref]] = []

    class KeepParameterCasts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and isinstance(args[0], nn.Parameter):
                casts.append((names.get(id(args[0]), "?"), weakref.ref(out)))
            return out

    def alive() -> dict[str, int]:
        gc.collect()
        held: dict[str, int] = {}
        for name, ref in casts:
            if (t := ref()) is not None:
                held[name] = held.get(name, 0) + t.untyped_storage().nbytes()
        return held

    seen = {}
    with KeepParameterCasts():
        with torch.autocast("cpu", dtype=dtype):
            loss = model(images).float().square().mean()
            seen["end of forward, inside autocast"] = alive()
        seen["after autocast exits"] = alive()
        loss.backward()
        seen["after backward"] = alive()
    return seen


def onednn_convolutions(model: nn.Module, images: torch.Tensor, labels: torch.Tensor,
                        dtype: torch.dtype) -> list[dict[str, str | float]]:
    """The oneDNN convolution primitives one autocast training step ran, and the implementation oneDNN chose.

    Turns on oneDNN's verbose mode (torch.backends.mkldnn.verbose) for one step and reads the "exec" lines it
    prints to the process's stdout (file descriptor 1, captured here). Each row: the pass
    ("forward_training", "backward_data", "backward_weights"), the implementation (a JIT kernel such as
    "brg_conv_fwd:avx10_1_512", or "ref:any", oneDNN's reference C++ loops) and oneDNN's own time in ms.
    An empty list means torch did not call oneDNN for the convolutions in this dtype."""
    import ctypes
    import os
    import sys
    import tempfile

    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                    loss = F.cross_entropy(model(images), labels)
                loss.backward()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines()
    rows = []
    for line in lines:
        fields = line.split(",")
        if len(fields) > 7 and fields[2:4] == ["primitive", "exec"] and fields[5] == "convolution":
            rows.append({"pass": fields[7], "implementation": fields[6], "ms": float(fields[-1])})
    return rows


def slow_convolution_share(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, dtype: torch.dtype,
                           steps: int = 3) -> float:
    """The share of `steps` autocast training steps' self CPU time (torch.profiler) spent in torch's own generic
    convolution code, the aten::_slow_conv2d_forward / _slow_conv2d_backward ops that torch runs when it does not
    hand a convolution to oneDNN. One untimed step first (warm-up)."""
    import os
    import sys

    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()

    step()
    sys.stderr.flush()
    saved = os.dup(2)  # the profiler's C++ side logs its start and stop (with timestamps) to fd 2: not the lesson's
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(steps):
                    step()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    slow = sum(e.self_cpu_time_total for e in events if e.key.startswith("aten::_slow_conv2d"))
    return slow / total if total else 0.0


def bytes_per_parameter(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes per parameter held in weights, gradients and optimizer state (after at least one step)."""
    count = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters() if p.grad is not None)
    state = sum(t.numel() * t.element_size() for per_param in optimizer.state.values()
                for t in per_param.values() if torch.is_tensor(t) and t.dim() > 0)  # Adam's `step` is a scalar
    return {"weights": weights / count, "gradients": grads / count, "optimizer state": state / count}


# ---------------------------------------------------------------------------- the exercise

def _reference_step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
                    images: torch.Tensor, labels: torch.Tensor, max_norm: float) -> float:
    with torch.autocast(device_type="cpu", dtype=torch.float16):
        loss = F.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    scaler.step(optimizer)
    scaler.update()
    return loss.item()


def _setup(init_scale: float, seed: int = 0) -> tuple:
    from helpers.kit.models import SimpleModel

    torch.manual_seed(seed)
    model = SimpleModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    images, labels = torch.rand(32, 1, 28, 28), torch.randint(0, 10, (32,))
    return model, optimizer, torch.amp.GradScaler("cpu", init_scale=init_scale), images, labels


def _same(model_a: nn.Module, model_b: nn.Module) -> bool:
    pairs = zip(model_a.parameters(), model_b.parameters(), strict=True)
    return all(torch.allclose(p, q, atol=1e-6, rtol=0) for p, q in pairs)


# GradScaler's errors for a step in the wrong order (torch/amp/grad_scaler.py), and what each one means here
_SCALER_ERRORS = (
    ("No inf checks were recorded prior to update",
     "scaler.update() found no inf checks: either the weights were stepped with optimizer.step() (step with"
     " scaler.step(optimizer), which checks the gradients for inf/NaN), or scaler.update() ran twice (the first"
     " call clears the checks; call it once per step, after scaler.step)"),
    ("_scale is None",
     "scaler.unscale_ or scaler.step found no scaled loss: backward ran on the plain loss (call"
     " scaler.scale(loss).backward())"),
)


def check_amp_train_step(train_step: Callable, max_norm: float = 0.1) -> bool:
    """Run `train_step(model, optimizer, scaler, images, labels, max_norm)` against the correct AMP step.

    Prints one line, "Correct: ..." or "Not yet: " and everything still wrong; returns True only if all is right.
    While `train_step` runs, a forward hook records whether autocast was on and with which dtype
    (torch.get_autocast_dtype), and clip_grad_norm_'s clipping function (`_clip_grads_with_norm_`, which
    clip_grad_norm_ calls at torch/nn/utils/clip_grad.py:231, however clip_grad_norm_ itself was imported) is
    wrapped to record whether the scaler had unscaled this optimizer's gradients yet (GradScaler's per-optimizer
    stage, OptState.UNSCALED, set by unscale_ at torch/amp/grad_scaler.py:361, or whether scaler.step had run);
    scaler.scale and scaler.step are wrapped to count their calls. GradScaler's own errors for a step in the wrong
    order (optimizer.step() then scaler.update(); backward without scaler.scale) become "Not yet" hints; any other
    error the learner's step raises (a typo) becomes a "Not yet" that names it and the learner's line."""
    from torch.amp.grad_scaler import OptState
    from torch.nn import utils as nn_utils
    from torch.nn.utils import clip_grad

    problems: dict[str, list[str]] = {}  # what is wrong -> in which cases
    for case, init_scale in (("a normal step", 2.0 ** 8), ("an overflowing step", 2.0 ** 60)):
        model, optimizer, scaler, images, labels = _setup(init_scale)
        ref_model, ref_scaler = copy.deepcopy(model), torch.amp.GradScaler("cpu", init_scale=init_scale)
        ref_optimizer = torch.optim.SGD(ref_model.parameters(), lr=0.5)
        before = copy.deepcopy(model)
        autocast_seen: list[torch.dtype | None] = []  # the autocast dtype in force at each forward pass, or None
        model.register_forward_hook(lambda *_, seen=autocast_seen: seen.append(
            torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None))
        clips: list[bool | str] = []  # one entry per clipping: were the gradients unscaled at that moment?
        in_autocast: list[str] = []  # what ran inside the autocast block that should hold the forward pass only
        clip_function = clip_grad._clip_grads_with_norm_
        step_calls: list[int] = []

        def recording_clip(*args, clips=clips, scaler=scaler, optimizer=optimizer, step_calls=step_calls,
                           clip_function=clip_function, in_autocast=in_autocast, **kwargs):
            state = scaler._per_optimizer_states[id(optimizer)]
            # "after step": scaler.step had run (its stage is STEPPED, or READY again once update() reset it)
            clips.append("after step" if step_calls else state["stage"] is OptState.UNSCALED)
            if torch.is_autocast_enabled("cpu"):
                in_autocast.append("the clipping")
            return clip_function(*args, **kwargs)

        scale_calls: list[int] = []
        scale_method = scaler.scale
        scaler.scale = lambda outputs, calls=scale_calls, method=scale_method: calls.append(1) or method(outputs)
        step_method = scaler.step

        def recording_step(*a, calls=step_calls, method=step_method, in_autocast=in_autocast, **k):
            if torch.is_autocast_enabled("cpu"):
                in_autocast.append("scaler.step")
            calls.append(1)
            return method(*a, **k)

        scaler.step = recording_step
        updates_before_step: list[bool] = []  # one entry per scaler.update(): had scaler.step run yet?
        update_method = scaler.update
        scaler.update = lambda *a, seen=updates_before_step, calls=step_calls, method=update_method, **k: (
            seen.append(not calls) or method(*a, **k))
        backward_in_autocast: list[bool] = []  # recorded by a gradient hook on the last layer's weight
        last_weight = list(model.parameters())[-1]
        last_weight.register_hook(lambda grad, seen=backward_in_autocast: seen.append(
            torch.is_autocast_enabled("cpu")) or None)
        # clip_grad_norm_ calls the private _clip_grads_with_norm_ (clip_grad.py:231); the public
        # nn.utils.clip_grads_with_norm_ (after nn.utils.get_total_norm) is the same function under another name,
        # bound when torch.nn.utils was imported (torch/nn/utils/__init__.py:3): both names are wrapped
        public_clip = nn_utils.clip_grads_with_norm_
        clip_grad._clip_grads_with_norm_ = nn_utils.clip_grads_with_norm_ = recording_clip
        try:
            train_step(model, optimizer, scaler, images, labels, max_norm)
        except Exception as error:  # GradScaler's own checks (torch/amp/grad_scaler.py), or the learner's typo
            hint = next((h for text, h in _SCALER_ERRORS if text in str(error)), None)
            if hint is None:  # not a step in the wrong order: name the error and the learner's line
                first = (str(error).splitlines() or [""])[0]
                name = getattr(train_step, "__name__", "your step")
                return not_yet(f"{name} raised {type(error).__name__}: {first}{your_line(train_step, error)} "
                               f"(in {case}; the check stopped there)")
            problems.setdefault(hint, []).append(case)
            continue
        finally:
            clip_grad._clip_grads_with_norm_, nn_utils.clip_grads_with_norm_ = clip_function, public_clip
        _reference_step(ref_model, ref_optimizer, ref_scaler, images, labels, max_norm)
        found = []
        wrong_dtype = False
        if not autocast_seen or None in autocast_seen:
            found.append("the forward pass did not run under torch.autocast")
        elif any(dtype != torch.float16 for dtype in autocast_seen):
            wrong_dtype = True
            used = ", ".join(sorted({str(dtype) for dtype in autocast_seen if dtype != torch.float16}))
            found.append(f"the forward pass ran under autocast with {used}; the exercise asks for "
                         "torch.autocast(\"cpu\", dtype=torch.float16), the format that needs the GradScaler")
        scale_wrong = scaler.get_scale() != ref_scaler.get_scale()
        # in another dtype the overflowing batch need not overflow: the scale and the skip are checked in fp16 only
        if scale_wrong and not wrong_dtype:
            got, expected = scaler.get_scale(), ref_scaler.get_scale()
            halved = (": after an overflow scaler.update() halves the scale, and here it was not halved" if
                      got == 2 * expected else "")
            found.append(f"the scale is {got:g}, expected {expected:g}{halved} (scale the loss with"
                         " scaler.scale(loss), and call scaler.update() once per step, after scaler.step(optimizer))")
        if any(backward_in_autocast):
            in_autocast.insert(0, "backward")
        if in_autocast:
            found.append(f"{', '.join(dict.fromkeys(in_autocast))} ran inside the autocast block: wrap only the "
                         "forward pass and the loss (backward already runs each op in the dtype autocast chose for "
                         "its forward, and PyTorch's AMP docs advise against backward under autocast)")
        # optimizer.step() in place of scaler.step(optimizer): said before the weights' hints, and update() is not
        # blamed for a step that never ran (updates_before_step is also true when scaler.step was never called)
        if scale_calls and not step_calls:
            found.append("scaler.step(optimizer) was never called: the weights were stepped with optimizer.step() or"
                         " not at all (step with scaler.step(optimizer), which skips the step when the gradients"
                         " overflowed)")
        update_before_step = any(updates_before_step) and bool(step_calls)
        if update_before_step:
            found.append("scaler.update() ran before scaler.step(optimizer): update() clears the record that "
                         "unscale_ had run, so scaler.step unscaled the (clipped) gradients a second time (call "
                         "scaler.step(optimizer), then scaler.update())")
        if not clips:
            found.append("clip_grad_norm_ was not called (clip after scaler.unscale_(optimizer))")
        elif "after step" in clips:
            found.append("clip_grad_norm_ ran after scaler.step(optimizer): the step had already used the unclipped"
                         " gradients (clip between scaler.unscale_(optimizer) and scaler.step(optimizer))")
        elif not all(clips) and scale_calls:  # without scaler.scale, unscale_ is not the next thing to fix
            found.append("clip_grad_norm_ ran before scaler.unscale_(optimizer): it clipped the scaled gradients"
                         " (call scaler.unscale_(optimizer) first, so that max_norm applies to the true gradients)")
        if not all(torch.isfinite(p).all() for p in model.parameters()):
            found.append("weights became inf/NaN (step with scaler.step(optimizer): it skips the step when"
                         " the gradients overflowed)")
        elif case == "an overflowing step" and not wrong_dtype and not _same(model, before):
            found.append("weights changed in the step whose scaled loss should overflow (the check starts the scaler at"
                         " 2**60; with scaler.scale(loss) the gradients overflow and scaler.step(optimizer) skips"
                         " the step)")
        elif case == "a normal step" and not _same(model, ref_model):
            if found and update_before_step and len(found) == 1:
                pass  # the double unscale is the reason, and its hint says so
            elif found:  # no autocast, a wrong dtype or scale, or wrong clipping change the weights too
                found.append("weights differ from the correct step (fix the other problems first: they change"
                             " the weights too)")
            else:  # autocast, scale and clipping order are right: something else moved the weights
                found.append("weights differ from the correct step (compute the loss inside the autocast block too,"
                             " where autocast runs cross_entropy in fp32; pass max_norm to clip_grad_norm_, call"
                             " optimizer.zero_grad() before backward, and step once with scaler.step(optimizer))")
        if not scale_calls and not wrong_dtype:  # the first thing to fix: the scale and weight checks follow from it
            found = [problem for problem in found if not problem.startswith(
                ("the scale is", "weights changed in the step", "weights differ"))]
            found.append("the loss was not scaled (call scaler.scale(loss).backward(), then scaler.unscale_(optimizer)"
                         " before clipping, scaler.step(optimizer) and scaler.update())")
        for problem in found:
            problems.setdefault(problem, []).append(case)
    if problems:
        return not_yet("; ".join(f"{problem} (in {' and in '.join(cases)})" for problem, cases in problems.items()))
    return correct("fp16 autocast forward, scaled backward, unscale_ before clipping, skipped step on overflow, "
                   "scale updated.")
