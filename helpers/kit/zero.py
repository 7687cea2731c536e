"""Worker kit for lesson 09 (build ZeRO yourself): shard arithmetic, storage helpers, the lesson's models,
and a log of the collectives a process issues.

    from helpers.kit.zero import CommLog, padded_flat, shard_size, free_storage, alloc_storage

- `padded_flat(tensor, world_size)`: the tensor flattened and padded with zeros to world_size * shard_size
  values; rank r's shard is `.chunk(world_size)[r]`. This is the lesson's sharding rule (ours; FSDP2 pads
  dim 0 instead, torch/distributed/fsdp/_fully_shard/_fsdp_param.py).
- `free_storage` / `alloc_storage`: what FSDP2 does to an unsharded parameter between uses
  (`_fsdp_param.py`, `alloc_storage` and `free_storage`): the tensor keeps its shape, its storage goes to
  0 bytes and back.
- `CommLog`: replaces the collectives and point-to-point calls on the `torch.distributed` namespace (the names in
  `LOGGED`: every public collective, send/recv, barrier, the object collectives, DDP's private
  `_broadcast_coalesced`, and the private `_all_gather_base` / `_reduce_scatter_base`, recorded as the
  `all_gather_single` / `reduce_scatter_single` they call) with wrappers that record each call (operation, bytes of
  the full, unsharded tensor, async_op, given by keyword or position) in order, then call torch's function.
  `_coalescing_manager` is a context manager, not a collective: the calls made inside it are recorded one by
  one. An `async_op=True` call hands back its work wrapped (a subclass of torch's `Work`), so that the log also
  records when it was first waited for (`wait()`, or `get_future()`). With `hold_outputs` set (lesson 09's check
  sets it while it trains the learner's class, never for torch's own runs), the output of such a call to an
  all-reduce, a reduce-scatter or an all-gather (the names in `_OUTPUT`: the list forms `all_gather` and
  `reduce_scatter` too, every tensor of the list) holds NaN from the moment the call returns until the work is first
  waited for, except any part that is also the call's input (an in-place all-gather's own chunk): the collective
  writes into a copy, which `wait()` copies in. Other collectives' outputs are not held
  (lesson 09's check rejects a step that issues any of them before it reads a value). A class that reads an output
  before its wait() then reads NaN on every run, where on a real run it reads whatever that memory held, or part of
  the result, depending on timing. A call counts only if it goes through `torch.distributed.<name>`:
  that is how the learner's classes, `ZeroRedundancyOptimizer` (dist.broadcast), DDP's constructor
  (dist._broadcast_coalesced, torch/distributed/utils.py:339), DDP's default comm hook (dist.all_reduce) and FSDP2
  (dist.all_gather_single, dist.reduce_scatter_single) call them in torch 2.14. Not seen: a method called on a
  ProcessGroup object itself (`group.allreduce(...)`), a call through `torch.distributed.distributed_c10d.<name>`,
  and C++ callers (DDP's reducer without a Python comm hook).
- `reachable_tensors` / `other_tensors`: the tensors an object holds, found through its attributes, containers,
  tensors' own attributes, functions' closures and the class attributes of the learner's classes, each with the
  path that reaches it (what lesson 09's check counts as memory a class keeps on the side).
- `hidden_storage`: the storages behind the class's own tensors (a shard, its gradient, optimizer state) that hold
  more than those tensors use: a shard that is a view of a whole padded copy keeps that copy alive, and
  `other_tensors` skips every storage a known tensor uses.
Imports only torch: workers and the notebook both use it.
"""
from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from helpers.kit.instruments import WrappedWork
from helpers.kit.tensors import storage_bytes  # noqa: F401  (lesson 09's workers import it from here)

STEPS, ACCUMULATE_STEP = 5, 3  # lesson 09's check: 5 optimizer steps; step 3 runs two backward passes before it

# operation -> which argument is the full (unsharded) tensor: its position, and its keyword
_FULL_TENSOR = {
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"),
    "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input"),
    "all_gather_into_tensor": (0, "output_tensor"), "all_gather_single": (0, "output_tensor"),
    "all_gather": (0, "tensor_list"), "reduce_scatter": (1, "input_list"),
    "_all_gather_base": (0, "output_tensor"), "_reduce_scatter_base": (1, "input"),
}
# operation -> the argument an async call writes its result into (a tensor, or all_gather's list of tensors): what
# hold_outputs keeps at NaN until the wait
_OUTPUT = {"all_reduce": "tensor", "all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
           "_all_gather_base": "output_tensor", "all_gather": "tensor_list", "reduce_scatter_single": "output",
           "reduce_scatter_tensor": "output", "_reduce_scatter_base": "output", "reduce_scatter": "output"}
# (log, call) -> (the outputs, the copies the collective writes into)
_HELD: dict[tuple[int, int], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
# private aliases, recorded under the public name they call (torch/distributed/distributed_c10d.py)
_ALIASES = {"_all_gather_base": "all_gather_single", "_reduce_scatter_base": "reduce_scatter_single"}
# the rest of torch.distributed's collectives and point-to-point calls: bytes of the first tensor (or list of them)
_OTHERS = ("reduce", "gather", "gather_into_tensor", "gather_single", "scatter", "all_to_all", "all_to_all_single",
           "send", "recv", "isend", "irecv",
           "batch_isend_irecv", "barrier", "monitored_barrier", "all_reduce_coalesced", "all_gather_coalesced",
           "all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list", "send_object_list",
           "recv_object_list", "_broadcast_coalesced")
LOGGED = tuple(_FULL_TENSOR) + _OTHERS


def shard_size(numel: int, world_size: int) -> int:
    """Values per rank when `numel` values are split over `world_size` ranks: rounded up."""
    return -(-numel // world_size)


def padded_flat(tensor: torch.Tensor, world_size: int) -> torch.Tensor:
    """`tensor` flattened, with zeros appended up to world_size * shard_size values (a new tensor)."""
    flat = tensor.detach().reshape(-1)
    padding = shard_size(flat.numel(), world_size) * world_size - flat.numel()
    return torch.cat([flat, flat.new_zeros(padding)])


def free_storage(tensor: torch.Tensor) -> None:
    """Give the tensor's memory back; it keeps its shape (as FSDP2's free_storage)."""
    if tensor.untyped_storage().size() != 0:
        tensor.untyped_storage().resize_(0)


def alloc_storage(tensor: torch.Tensor) -> None:
    """Give a freed tensor memory again (uninitialised; copy values in before use)."""
    size = tensor.numel() * tensor.element_size()
    if tensor.untyped_storage().size() != size:
        tensor.untyped_storage().resize_(size)


def storage_key(tensor: torch.Tensor) -> int:
    """Which storage a tensor uses: the same number for every view of it, while it lives."""
    return tensor.untyped_storage()._cdata


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    if hasattr(value, "tensor"):  # a P2POp of batch_isend_irecv
        return _nbytes(value.tensor)
    return 0


def _first_tensors(args, kwargs):
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor) or (isinstance(value, (list, tuple)) and value
                                               and (isinstance(value[0], torch.Tensor) or hasattr(value[0], "tensor"))):
            return value
    return []


def _tensors(value) -> list[torch.Tensor]:
    """The tensors of an argument: the tensor itself, or those of a list or tuple."""
    if isinstance(value, torch.Tensor):
        return [value]
    return [v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (list, tuple)) else []


def is_call(event: dict) -> bool:
    """True for a recorded collective or point-to-point call; False for a marker or a wait."""
    return event["op"] not in ("mark", "wait")


class _LoggedWork(WrappedWork):
    """torch's Work of an async_op=True call, with the first wait() (or get_future()) recorded in the log; with
    hold_outputs, the result is copied into the call's output once the work is waited for."""

    def __init__(self, work: dist.Work, log: CommLog, call: int) -> None:
        super().__init__(work)
        self.log, self.call, self.waited = log, call, False

    def _note(self) -> None:
        if not self.waited:
            self.waited = True
            self.log.events.append({"op": "wait", "id": self.call})

    def _deliver(self) -> None:
        held = _HELD.pop((id(self.log), self.call), None)
        if held is not None:
            with torch.no_grad():
                for output, copy in zip(*held, strict=True):
                    output.copy_(copy)

    def wait(self, timeout=None) -> bool:
        self._note()
        done = super().wait(timeout)
        self._deliver()
        return done

    def get_future(self):
        self._note()
        if (id(self.log), self.call) not in _HELD:
            return self.work.get_future()
        return self.work.get_future().then(lambda future: (self._deliver(), future.value())[1])


class CommLog:
    """Records every call of the names in LOGGED through torch.distributed while installed (the list `events`):
    {"op", "bytes", "async", "id"} per call, {"op": "wait", "id"} when an async call is first waited for, and the
    markers of `mark`. Ours, not torch's CommDebugMode: the grader needs each call's order between marks, its bytes,
    whether it was async and when it was waited for; CommDebugMode keeps one count per op and the sizes of DTensor
    arguments only (torch/distributed/tensor/debug/_comm_mode.py)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._originals: dict = {}
        self._calls = 0
        self.hold_outputs = False  # True: an async call's output holds NaN until its work is waited for

    def install(self) -> CommLog:
        for name in LOGGED:
            if hasattr(dist, name):
                original = self._originals[name] = getattr(dist, name)
                setattr(dist, name, self._wrap(name, original, *_FULL_TENSOR.get(name, (None, None))))
        return self

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()
        for key in [key for key in _HELD if key[0] == id(self)]:
            del _HELD[key]

    def _wrap(self, name, original, position, keyword):
        try:
            signature = inspect.signature(original)
        except (TypeError, ValueError):
            signature = None

        def is_async(args, kwargs) -> bool:  # async_op by keyword or by position
            try:
                return bool(signature.bind(*args, **kwargs).arguments.get("async_op"))
            except (AttributeError, TypeError):
                return bool(kwargs.get("async_op"))

        def recorded(*args, **kwargs):
            if position is None:
                full = _first_tensors(args, kwargs)
            else:
                full = kwargs[keyword] if keyword in kwargs else args[position]
            self._calls += 1
            call = self._calls
            asynchronous = is_async(args, kwargs)
            self.events.append({"op": _ALIASES.get(name, name), "bytes": _nbytes(full), "async": asynchronous,
                                "id": call})
            if self.hold_outputs and asynchronous and name in _OUTPUT and signature is not None:
                args, kwargs = self._hold(call, signature, _OUTPUT[name], args, kwargs)
            work = original(*args, **kwargs)
            return _LoggedWork(work, self, call) if isinstance(work, dist.Work) else work
        return recorded

    def _hold(self, call: int, signature: inspect.Signature, output: str, args, kwargs):
        """The arguments with the output (each tensor of an output list) replaced by a copy (the collective writes
        there), the output set to NaN, except where another argument shares its memory: an in-place all-gather reads
        its input from its output's memory, so that part keeps its values (as it does on a real run)."""
        bound = signature.bind(*args, **kwargs)
        out = bound.arguments.get(output)
        outs = _tensors(out)
        if not outs or len(outs) != (len(out) if isinstance(out, (list, tuple)) else 1) or any(
                not t.is_floating_point() for t in outs):
            return args, kwargs
        inputs = [t for name, value in bound.arguments.items() if name != output for t in _tensors(value)
                  if any(t.untyped_storage().data_ptr() == o.untyped_storage().data_ptr() for o in outs)]
        kept = [(t, t.detach().clone()) for t in inputs]
        copies = [t.detach().clone() for t in outs]
        bound.arguments[output] = copies if isinstance(out, (list, tuple)) else copies[0]
        with torch.no_grad():
            for t in outs:
                t.fill_(float("nan"))
            for t, values in kept:  # an input inside the output's memory: the collective reads it
                t.copy_(values)
        _HELD[(id(self), call)] = (outs, copies)
        return bound.args, bound.kwargs

    def mark(self, label: str, **facts) -> None:
        """Put a marker (e.g. "forward end 2") between the recorded calls, with any facts about that moment."""
        self.events.append({"op": "mark", "label": label, **facts})

    def take(self) -> list[dict]:
        """The events so far; the log starts empty again."""
        events, self.events = self.events, []
        return events


_NOT_LEARNERS = ("torch", "builtins", "abc", "typing", "collections", "enum", "functools")
_MODULE_CHILDREN = ("_parameters", "_buffers", "_modules")


def _key(key) -> str:
    if isinstance(key, (str, int)):
        text = repr(key)
        return text if len(text) <= 24 else text[:21] + "..."
    return "<tensor>" if isinstance(key, torch.Tensor) else f"<{type(key).__name__}>"


def _attributes(items, path: str) -> list[tuple[object, str]]:
    found = []
    for name, value in items:
        if name in _MODULE_CHILDREN and isinstance(value, dict):  # a module's parameters, buffers, submodules
            found += [(child, f"{path}.{key}") for key, child in value.items()]
        elif "hook" in name and isinstance(value, dict):  # hook dicts: keyed by a process-wide counter, not shown
            found += [(hook, f"{path}.{name}[<hook>]") for hook in value.values()]
        else:
            found.append((value, f"{path}.{name}"))
    return found


def _children(obj, path: str) -> list[tuple[object, str]]:
    """What `obj` refers to, each with the path that reaches it from a root."""
    if isinstance(obj, torch.Tensor):  # the tensor's own Python attributes (torch keeps only hook dicts there)
        return _attributes(getattr(obj, "__dict__", {}).items(), path)
    if isinstance(obj, types.FunctionType):  # closure cells and default arguments
        cells = []
        for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False):
            try:
                cells.append((cell.cell_contents, f"{path} (closure of {obj.__qualname__}: {name})"))
            except ValueError:  # a cell not yet filled
                pass
        defaults = list(obj.__defaults__ or ()) + list((obj.__kwdefaults__ or {}).values())
        return cells + [(value, f"{path} (default of {obj.__qualname__})") for value in defaults]
    if isinstance(obj, types.MethodType):
        return [(obj.__func__, path), (obj.__self__, path)]
    if isinstance(obj, functools.partial):
        return [(obj.func, path)] + [(value, f"{path} (argument of a partial)")
                                     for value in (*obj.args, *obj.keywords.values())]
    if isinstance(obj, dict):
        return [(key, f"{path} (a key)") for key in obj] + [(value, f"{path}[{_key(key)}]")
                                                             for key, value in obj.items()]
    if isinstance(obj, (list, tuple)):
        return [(value, f"{path}[{i}]") for i, value in enumerate(obj)]
    if isinstance(obj, (set, frozenset)):
        return [(value, f"{path} (in a set)") for value in obj]
    if not hasattr(obj, "__dict__") or isinstance(obj, (type, types.ModuleType)):
        return []
    found = _attributes(vars(obj).items(), path)
    for cls in type(obj).__mro__:  # class attributes of the learner's own classes (`cache = {}` in the class body)
        if cls.__module__.split(".")[0] not in _NOT_LEARNERS:
            found += [(value, f"{cls.__name__}.{name}") for name, value in vars(cls).items()
                      if not name.startswith("__") and not isinstance(value, (property, staticmethod, classmethod))]
    return found


def reachable_tensors(**roots) -> list[tuple[torch.Tensor, str]]:
    """Every tensor reachable from the named `roots` (e.g. Zero3=the class's object, model=the model), each with a
    path that reaches it ("Zero3.kept[<tensor>]"): through attributes of objects, modules and tensors (a buffer hung
    on a parameter or a shard, `p._full = ...`), dicts, lists, tuples and sets, functions kept there (hooks included:
    their closure cells and default arguments), bound methods, functools.partial, and the class attributes of classes
    outside torch and the standard library. Not through a function's globals, modules or C++ objects: a tensor kept in
    a module-level global or in a pending collective is not seen."""
    seen, found = set(), []
    todo = [(obj, name) for name, obj in reversed(roots.items())]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append((obj, path))
        todo += reversed(_children(obj, path))
    return found


def other_tensors(known: Iterable[torch.Tensor], **roots) -> dict:
    """The tensor storages reachable from `roots` that are none of `known` (for lesson 09: the class's parameters,
    gradients, shards, their gradients, optimizer state): their count, total bytes, and the shape and path of the
    largest."""
    skip = {storage_key(t) for t in known if t is not None}
    other: dict[int, tuple[int, tuple, str]] = {}
    for tensor, path in reachable_tensors(**roots):
        key, size = storage_key(tensor), tensor.untyped_storage().size()
        if key not in skip and size and (key not in other or size > other[key][0]):
            other[key] = (size, tuple(tensor.shape), path)
    largest = max(other.values(), key=lambda found: found[0], default=(0, (), ""))
    return {"tensors": len(other), "bytes": sum(size for size, _, _ in other.values()), "largest": list(largest[1]),
            "where": largest[2]}


def hidden_storage(named: Iterable[tuple[str, torch.Tensor | None]], world_size: int) -> dict | None:
    """The storage behind the named tensors (lesson 09: a class's shards, their gradients, optimizer state) that
    holds the most bytes none of them uses, when that is more than padding explains ((world_size - 1) values per
    tensor that uses it): {"what": the name of the largest tensor using it, "bytes": the storage's bytes, "used": the
    bytes the named tensors use of it}. None when there is none. `other_tensors` skips a storage a known tensor uses,
    so a shard that is a view of a whole padded copy (`padded_flat(p, N).chunk(N)[r]` without `.clone()`) would hide
    the rest of that copy; this finds it."""
    spans: dict[int, list] = {}
    for name, tensor in named:
        if tensor is None or not tensor.numel():
            continue
        size, start = tensor.element_size(), tensor.storage_offset()
        end = start + 1 + sum((n - 1) * abs(stride) for n, stride in zip(tensor.shape, tensor.stride(), strict=True))
        entry = spans.setdefault(storage_key(tensor), [tensor.untyped_storage().size(), [], []])
        entry[1].append((start * size, end * size))
        entry[2].append((tensor.numel() * size, name, size))
    worst = None
    for total, intervals, tensors in spans.values():
        used, reach = 0, 0
        for start, end in sorted(intervals):  # the bytes covered by the union of the tensors' spans
            used += max(0, end - max(start, reach))
            reach = max(reach, end)
        slack = (world_size - 1) * max(size for _, _, size in tensors) * len(tensors)
        if total - used > slack and (worst is None or total - used > worst["bytes"] - worst["used"]):
            worst = {"what": max(tensors)[1], "bytes": total, "used": used}
    return worst


class TiedPair(nn.Module):
    """x -> a(x) -> relu -> b(.), where b uses a's weight (tied): 99 parameters, an odd count."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(9, 9), nn.Linear(9, 9)
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def build_model(name: str, seed: int = 0) -> tuple[nn.Module, list[nn.Module], int]:
    """The lesson's models: (model, its units = the Linear layers, input width). Same seed, same weights.

    mlp: 4,426 parameters, even sizes; odd: 55 parameters, every tensor odd; tied: 99, one weight shared.
    """
    torch.manual_seed(seed)
    if name == "mlp":
        model = nn.Sequential(nn.Linear(32, 48), nn.ReLU(), nn.Linear(48, 48), nn.ReLU(), nn.Linear(48, 10))
        width = 32
    elif name == "odd":
        model, width = nn.Sequential(nn.Linear(7, 5), nn.ReLU(), nn.Linear(5, 3, bias=False)), 7
    elif name == "tied":
        model, width = TiedPair(), 9
    else:
        raise ValueError(f"unknown model {name!r}; choose mlp, odd or tied")
    return model, [m for m in model.modules() if isinstance(m, nn.Linear)], width
