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
  one. A call counts only if it goes through `torch.distributed.<name>`:
  that is how the learner's classes, `ZeroRedundancyOptimizer` (dist.broadcast), DDP's constructor
  (dist._broadcast_coalesced, torch/distributed/utils.py:339), DDP's default comm hook (dist.all_reduce) and FSDP2
  (dist.all_gather_single, dist.reduce_scatter_single) call them in torch 2.14. Not seen: a method called on a
  ProcessGroup object itself (`group.allreduce(...)`), a call through `torch.distributed.distributed_c10d.<name>`,
  and C++ callers (DDP's reducer without a Python comm hook).
Imports only torch: workers and the notebook both use it.
"""
from __future__ import annotations

import inspect

import torch
import torch.distributed as dist
from torch import nn

from helpers.kit.tensors import storage_bytes  # noqa: F401  (lesson 09's workers import it from here)

# operation -> which argument is the full (unsharded) tensor: its position, and its keyword
_FULL_TENSOR = {
    "all_reduce": (0, "tensor"), "broadcast": (0, "tensor"),
    "reduce_scatter_tensor": (1, "input"), "reduce_scatter_single": (1, "input"),
    "all_gather_into_tensor": (0, "output_tensor"), "all_gather_single": (0, "output_tensor"),
    "all_gather": (0, "tensor_list"), "reduce_scatter": (1, "input_list"),
    "_all_gather_base": (0, "output_tensor"), "_reduce_scatter_base": (1, "input"),
}
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


class CommLog:
    """Records every call of the names in LOGGED through torch.distributed while installed (the list `events`)."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        self._originals: dict = {}

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
            self.events.append({"op": _ALIASES.get(name, name), "bytes": _nbytes(full),
                                "async": is_async(args, kwargs)})
            return original(*args, **kwargs)
        return recorded

    def mark(self, label: str, **facts) -> None:
        """Put a marker (e.g. "forward end 2") between the recorded calls, with any facts about that moment."""
        self.events.append({"op": "mark", "label": label, **facts})

    def take(self) -> list[dict]:
        """The events so far; the log starts empty again."""
        events, self.events = self.events, []
        return events


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
