"""Worker kit for lesson 12 (context parallelism and expert parallelism): what the graded workers share.

    from helpers.kit.context_experts import block_attention, block_attention_backward     # given to the learner
    from helpers.kit.context_experts import route, capacity_keep, build_moe               # given to the learner

Context parallelism (ring attention):
- `block_attention(q, k, v, diagonal)`: softmax attention of some queries over one block of keys, returning the
  output and the log-sum-exp of each query's scores (what a merge needs). `diagonal=True` applies the causal mask
  inside the block (query i sees keys 0..i of the block): the block where the queries' chunk meets its own keys.
- `block_attention_backward(...)`: the gradients of one block, given the *final* output and log-sum-exp of the
  queries (FlashAttention's backward rule, as picotron's ring_attention_backward writes it).
- `layout(kind, world_size)`: which chunks of the sequence each rank holds ("contiguous": rank r holds chunk r;
  "balanced": chunks r and 2N-1-r, torch's round-robin/head-tail layout for causal load balance).
- `block_pairs`, `expected_work`: which (query chunk, key chunk) blocks attention needs; `simulated_ring`: every
  rank's output computed in one process, exactly or with a named mistake (the check's diagnosis).
- `merge_reference`: the log-sum-exp merge, for the simulations and our rebuilds. The learner writes their own.

Expert parallelism (a mixture of experts with its experts split over ranks):
- `build_moe`: the lesson's router and experts; `route`: top-2 routing; `capacity_keep`: which assignments fit
  an expert's capacity on one rank; `reference_moe`: the whole layer in one process; `switch_aux_loss`.

Counting:
- `CommCounter`: a TorchDispatchMode that records every collective and point-to-point call that goes through the
  dispatcher (c10d's ops from `dist.*`, and the functional collectives torch's own ring attention uses), with the
  bytes that leave this rank; `count_flops`: FlopCounterMode's total, with torch's SDPA formula registered for the
  CPU flash op (which FlopCounterMode does not count by itself in torch 2.14).
- `HeldReceives`: while active, the buffer of every `dist.irecv` holds NaN until its request's `wait()` returns (the
  check's way to make a buffer read before its wait fail on every run, as lesson 09's check does for async
  collectives).
Imports only torch: workers and the notebook both use it.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from helpers.kit.instruments import WrappedWork

# ----------------------------------------------------------------------------------------- attention blocks


def block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    diagonal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of queries q [..., Sq, d] over the keys and values k, v [..., Sk, d] of one block.

    Returns (out [..., Sq, d], lse [..., Sq]): lse is the log of the sum of exp(score) over this block's keys, what a
    later merge with other blocks needs. diagonal: the causal mask inside the block (needs Sq == Sk)."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if diagonal:
        scores = scores.masked_fill(_above_diagonal(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse.unsqueeze(-1)) @ v, lse


def block_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, grad_out: torch.Tensor,
                             diagonal: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's share of the gradients (dq, dk, dv), given the queries' FINAL output, log-sum-exp and output
    gradient (after every block was merged). The probabilities are recomputed, exp(score - final lse), so each block's
    share adds up to the whole gradient: dq sums over the blocks a rank's queries meet, dk and dv over the queries
    their block meets."""
    scale = 1 / math.sqrt(q.shape[-1])
    scores = (q @ k.transpose(-2, -1)) * scale
    if diagonal:
        scores = scores.masked_fill(_above_diagonal(q.shape[-2], k.shape[-2], q.device), float("-inf"))
    probabilities = torch.exp(scores - lse.unsqueeze(-1))
    grad_v = probabilities.transpose(-2, -1) @ grad_out
    grad_probabilities = grad_out @ v.transpose(-2, -1)
    grad_scores = probabilities * (grad_probabilities - (grad_out * out).sum(dim=-1, keepdim=True))
    return (grad_scores @ k) * scale, (grad_scores.transpose(-2, -1) @ q) * scale, grad_v


def _above_diagonal(rows: int, columns: int, device: torch.device) -> torch.Tensor:
    if rows != columns:
        raise ValueError(f"a diagonal block needs as many queries as keys, got {rows} and {columns}")
    return torch.ones(rows, columns, dtype=torch.bool, device=device).triu(1)


def merge_reference(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
                    block_lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions of the same queries over disjoint keys, merged into one (the online softmax)."""
    new_lse = torch.logaddexp(lse, block_lse)
    return (torch.exp(lse - new_lse).unsqueeze(-1) * out
            + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out), new_lse


# ------------------------------------------------------------------------------------- layouts and work

LAYOUTS = ("contiguous", "balanced")


def layout(kind: str, world_size: int) -> list[list[int]]:
    """layout[r]: the chunks of the sequence rank r holds, in the order its tensors hold them."""
    if kind == "contiguous":
        return [[rank] for rank in range(world_size)]
    if kind == "balanced":
        return [[rank, 2 * world_size - 1 - rank] for rank in range(world_size)]
    raise ValueError(f"layout must be one of {LAYOUTS}, not {kind!r}")


def positions(chunks: list[int], seq: int, n_chunks: int) -> torch.Tensor:
    """The sequence positions of `chunks` (each seq / n_chunks long), in that order."""
    size = seq // n_chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunks])


def block_pairs(mine: list[int], theirs: list[int], causal: bool) -> Iterator[tuple[int, int, bool]]:
    """(i, j, diagonal) for each of my query chunks i and their key chunks j that attention needs: every pair
    without a mask; with a causal mask, key chunks before the query chunk (whole) and the same chunk (diagonal)."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            if not causal or b < a:
                yield i, j, False
            elif b == a:
                yield i, j, True


def expected_work(chunk_layout: list[list[int]], causal: bool) -> list[dict[str, int]]:
    """Per rank: the score blocks attention needs (counted in chunk x chunk blocks) and how many are diagonal."""
    work = []
    for mine in chunk_layout:
        pairs = [p for theirs in chunk_layout for p in block_pairs(mine, theirs, causal)]
        work.append({"blocks": len(pairs), "diagonal": sum(1 for *_, d in pairs if d)})
    return work


def block_flops(batch: int, heads: int, rows: int, head_dim: int) -> int:
    """FLOPs of one forward score block of rows x rows: q k^T and p v, 2 FLOPs per multiply-add."""
    return 2 * 2 * batch * heads * rows * rows * head_dim


# what a learner's ring may get wrong, each simulated in one process (the check names the one an output matches).
# "sent the other way round" (blocks travel to rank - 1, taken for rank (rank - s)'s) gives the same outputs as a
# ring that sends the right way but takes the block at step s for rank (rank + s)'s: over all steps, the same pairs.
# "block labelled one step off": the block that arrives at step s is rank (rank - s)'s, but the code reads its chunk
# numbers from layout[(rank - s - 1) % N] or layout[(rank - s + 1) % N] (the same ring on 2 ranks).
MISTAKES = ("no diagonal mask", "blocks above the diagonal computed", "sent the other way round",
            "sum of blocks, not merged", "block labelled one step off", "causal ignored",
            "blocks above the diagonal masked")
LABEL_OFF_BY = (-1, 1)


def simulated_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk_layout: list[list[int]], causal: bool,
                   mistake: str | None = None, steps: int | None = None,
                   label_off: int | None = None) -> list[torch.Tensor]:
    """Every rank's ring-attention output, computed in one process from the whole q, k, v [B, H, S, d].

    mistake: one of MISTAKES, or None for the right answer; steps: stop the ring after this many steps;
    label_off: for "block labelled one step off", which way (LABEL_OFF_BY; -1, one step behind, by default)."""
    if mistake == "block labelled one step off":
        label_off = -1 if label_off is None else label_off
        if label_off not in LABEL_OFF_BY:
            raise ValueError(f"label_off must be one of {LABEL_OFF_BY}, not {label_off}")
    else:
        label_off = 0
    world_size = len(chunk_layout)
    n_chunks = sum(len(row) for row in chunk_layout)
    seq = q.shape[-2]
    outputs = []
    for rank, mine in enumerate(chunk_layout):
        queries = q[..., positions(mine, seq, n_chunks), :].chunk(len(mine), dim=-2)
        outs: list[Any] = [None] * len(mine)
        for step in range(world_size if steps is None else steps):
            # whose keys arrive at this step, and whose the ring's code takes them for
            holder = (rank + step if mistake == "sent the other way round" else rank - step) % world_size
            label = (rank - step + label_off) % world_size
            theirs = chunk_layout[label]
            keys = k[..., positions(chunk_layout[holder], seq, n_chunks), :].chunk(len(theirs), dim=-2)
            values = v[..., positions(chunk_layout[holder], seq, n_chunks), :].chunk(len(theirs), dim=-2)
            for i, j, diagonal in _pairs_with(mistake, mine, theirs, causal):
                block = block_attention(queries[i], keys[j], values[j], diagonal)
                if outs[i] is None:
                    outs[i] = block
                elif mistake == "sum of blocks, not merged":
                    outs[i] = (outs[i][0] + block[0], outs[i][1])
                else:
                    outs[i] = merge_reference(*outs[i], *block)
        outputs.append(torch.cat([o[0] for o in outs], dim=-2))
    return outputs


def _pairs_with(mistake: str | None, mine: list[int], theirs: list[int],
                causal: bool) -> Iterator[tuple[int, int, bool]]:
    if mistake == "no diagonal mask":
        yield from ((i, j, False) for i, j, _ in block_pairs(mine, theirs, causal))
    elif mistake == "blocks above the diagonal computed":
        for i, a in enumerate(mine):
            for j, b in enumerate(theirs):
                yield i, j, causal and a == b
    elif mistake == "causal ignored":  # exercise 2's ring run with causal=True: every block, no mask
        yield from block_pairs(mine, theirs, False)
    elif mistake == "blocks above the diagonal masked":  # the diagonal's triangle applied above it too
        for i, a in enumerate(mine):
            for j, b in enumerate(theirs):
                yield i, j, causal and b >= a
    else:
        yield from block_pairs(mine, theirs, causal)


# ------------------------------------------------------------------------------------ counting


class CommCounter(TorchDispatchMode):
    """Records every communication op the dispatcher sees while active: c10d's ops (what dist.send, dist.isend,
    dist.all_to_all_single, dist.all_gather_into_tensor, dist.all_gather... call) and the functional collectives
    (torch.distributed._functional_collectives, what torch's ring attention calls). Each event: the op, the
    bytes handed to it, and `sent`: the bytes that must leave this rank (for an all-gather, this rank's input once
    for each of the others; for an all-to-all, the rows for the other ranks; for a send, the tensor). An all-gather's
    and a reduce-scatter's group size comes from the call (output / input elements, or the functional op's
    group_size), so calls on a sub-group count right; the others assume `world_size` ranks."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size
        self.events: list[dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.overloadpacket)
        if name.startswith(("c10d.", "_c10d_functional.", "c10d_functional.")) and not any(
                word in name for word in ("wait", "_wrap_tensor_autograd")):  # waits and autograd wrappers move none
            event = self._describe(name.split(".", 1)[1], args)
            if event is not None:
                self.events.append(event)
        return func(*args, **kwargs)

    def _describe(self, op: str, args: tuple) -> dict[str, Any] | None:
        others = self.world_size - 1
        if op in ("send", "recv_"):  # (tensors, group, the peer's rank in the group, tag)
            tensor = args[0][0]
            nbytes = _nbytes(tensor)
            return {"op": op.rstrip("_"), "bytes": nbytes, "sent": nbytes if op == "send" else 0, "peer": args[2]}
        if op in ("all_to_all_single", "alltoall_base_"):
            if op == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group)
                tensor, in_splits = args[0], args[2]
            else:  # (output, input, group, output_split_sizes, input_split_sizes, ...)
                tensor, in_splits = args[1], args[4]
            row = _nbytes(tensor) // max(tensor.shape[0], 1) if tensor.dim() else _nbytes(tensor)
            splits = list(in_splits) if in_splits else [tensor.shape[0] // self.world_size] * self.world_size
            sent = sum(rows for peer, rows in enumerate(splits) if peer != self.rank) * row
            return {"op": "all_to_all", "bytes": _nbytes(tensor), "sent": sent, "splits": splits}
        if op in ("all_gather_into_tensor", "_allgather_base_"):  # the group's size from the call itself
            tensor, size = (args[0], args[1]) if op == "all_gather_into_tensor" else (
                args[1], args[0].numel() // max(args[1].numel(), 1))
            return {"op": "all_gather", "bytes": _nbytes(tensor), "sent": (size - 1) * _nbytes(tensor),
                    "group": size}
        if op == "allgather_":  # the list form (dist.all_gather, dist.nn.functional.all_gather): ([[out] * size], [in])
            tensor, size = args[1][0], len(args[0][0])
            return {"op": "all_gather", "bytes": _nbytes(tensor), "sent": (size - 1) * _nbytes(tensor),
                    "group": size}
        if op in ("reduce_scatter_tensor", "_reduce_scatter_base_"):
            tensor, size = (args[0], args[2]) if op == "reduce_scatter_tensor" else (
                args[1], args[1].numel() // max(args[0].numel(), 1))
            return {"op": "reduce_scatter", "bytes": _nbytes(tensor), "sent": (size - 1) * _nbytes(tensor) // size,
                    "group": size}
        if op in ("all_reduce", "allreduce_"):
            tensor = args[0] if op == "all_reduce" else args[0][0]
            return {"op": "all_reduce", "bytes": _nbytes(tensor),
                    "sent": 2 * others * _nbytes(tensor) // self.world_size}
        return {"op": op, "bytes": 0, "sent": 0}

    def take(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _HeldWork(WrappedWork):
    """The Work of a held irecv: wait() waits for the real receive, then copies what arrived into the caller's
    buffer (until then it holds NaN)."""

    def __init__(self, work: dist.Work, buffer: torch.Tensor, arrived: torch.Tensor, held: HeldReceives) -> None:
        super().__init__(work)
        self.buffer, self.arrived, self.held, self.delivered = buffer, arrived, held, False

    def wait(self, timeout=None) -> bool:
        done = super().wait(timeout)
        if not self.delivered:
            self.delivered = True
            with torch.no_grad():
                self.buffer.copy_(self.arrived)
        return done


class HeldReceives:
    """While active (a context manager), `dist.irecv` receives into a copy and fills the caller's buffer with NaN;
    the request's wait() copies what arrived into the buffer. A buffer used before its wait() then holds NaN on every
    run, not whatever a race left there (on gloo a small message often arrives before the wait, so the mistake passes
    on one run and fails on the next). Ours, for the check: torch's irecv writes into the buffer itself whenever the
    data arrives. `unwaited()`: how many held receives were never waited for so far. Also installed as
    distributed_c10d.irecv, so that `dist.P2POp(dist.irecv, ...)` and `batch_isend_irecv` accept it."""

    def __init__(self) -> None:
        self.receives: list[_HeldWork] = []
        self._original = None

    def __enter__(self) -> HeldReceives:
        from torch.distributed import distributed_c10d

        original = self._original = distributed_c10d.irecv

        def irecv(tensor, *args, **kwargs):
            if not (isinstance(tensor, torch.Tensor) and tensor.is_floating_point() and tensor.is_contiguous()):
                return original(tensor, *args, **kwargs)
            arrived = torch.empty_like(tensor)
            with torch.no_grad():
                tensor.fill_(float("nan"))
            work = original(arrived, *args, **kwargs)
            if work is None:  # this rank is not in the group: nothing arrives
                return work
            self.receives.append(_HeldWork(work, tensor, arrived, self))
            return self.receives[-1]

        distributed_c10d.irecv = dist.irecv = irecv
        return self

    def __exit__(self, *exc) -> None:
        from torch.distributed import distributed_c10d

        distributed_c10d.irecv = dist.irecv = self._original

    def unwaited(self) -> int:
        return sum(not held.delivered for held in self.receives)


def _register_cpu_flash_flops() -> None:
    """FlopCounterMode counts the CUDA flash/efficient SDPA ops; give the CPU flash op torch's same formulas."""
    from torch.utils import flop_counter

    aten = torch.ops.aten
    if aten._scaled_dot_product_flash_attention_for_cpu in flop_counter.flop_registry:
        return

    def forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_flop_count(query_shape, key_shape, value_shape)

    def backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return flop_counter.sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)(forward)
    flop_counter.register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)(backward)


def flop_counter() -> Any:
    """torch's FlopCounterMode (no printed table), counting the CPU flash op too."""
    from torch.utils.flop_counter import FlopCounterMode

    _register_cpu_flash_flops()
    return FlopCounterMode(display=False)


# -------------------------------------------------------------------------------- mixture of experts

DIM, HIDDEN, NUM_EXPERTS, TOP_K = 8, 16, 4, 2


class Expert(nn.Module):
    """One expert: a small MLP, dim -> hidden -> dim."""

    def __init__(self, dim: int = DIM, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.relu(self.w1(x)))


def build_moe(num_experts: int = NUM_EXPERTS, dim: int = DIM, hidden: int = HIDDEN,
              seed: int = 0) -> tuple[nn.Linear, nn.ModuleList]:
    """The lesson's router (Linear dim -> num_experts, no bias) and experts: the same weights for the same seed."""
    torch.manual_seed(seed)
    router = nn.Linear(dim, num_experts, bias=False)
    return router, nn.ModuleList(Expert(dim, hidden) for _ in range(num_experts))


MOE_TOKENS = 16  # tokens per rank in the lesson's expert-parallel check


def moe_tokens(world_size: int, tokens: int = MOE_TOKENS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's tokens and output gradients in the expert-parallel check (seed 1): the same lists on every rank
    and in the notebook, so each can compute the one-process reference."""
    generator = torch.Generator().manual_seed(1)
    x = [torch.randn(tokens, DIM, generator=generator) for _ in range(world_size)]
    return x, [torch.randn(tokens, DIM, generator=generator) for _ in range(world_size)]


def route(x: torch.Tensor, router: nn.Linear, top_k: int = TOP_K) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k routing: (experts [T, k], weights [T, k], probabilities [T, E]). The weights are the chosen
    experts' softmax probabilities renormalised to sum to 1 (the same as a softmax over the chosen logits)."""
    probabilities = torch.softmax(router(x), dim=-1)
    top, experts = probabilities.topk(top_k, dim=-1)
    return experts, top / top.sum(dim=-1, keepdim=True), probabilities


def capacity(tokens: int, num_experts: int, capacity_factor: float, top_k: int = TOP_K) -> int:
    """How many of one rank's assignments an expert takes: floor(capacity_factor x tokens x top_k / experts)."""
    return math.floor(capacity_factor * tokens * top_k / num_experts)


def capacity_keep(experts: torch.Tensor, num_experts: int, limit: int) -> torch.Tensor:
    """Which assignments [T, k] fit: each expert takes at most `limit` of them, first choices before second
    choices (GShard's order), earlier tokens first within each. Returns a bool tensor [T, k]."""
    order = experts.t().reshape(-1)  # slot-major: every token's first choice, then every token's second
    one_hot = nn.functional.one_hot(order, num_experts)
    place = (one_hot.cumsum(dim=0) * one_hot).sum(dim=-1) - 1  # this assignment's place in its expert's queue
    return (place < limit).reshape(experts.shape[1], experts.shape[0]).t()


def reference_moe(groups: list[torch.Tensor], router: nn.Linear, experts: nn.ModuleList, top_k: int = TOP_K,
                  capacity_factor: float | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The whole layer in one process: every group (one rank's tokens) routed, its capacity applied within the
    group, every expert run on the tokens it keeps. Returns (outputs per group, kept [T, k] per group)."""
    outputs, kept = [], []
    for x in groups:
        chosen, weights, _ = route(x, router, top_k)
        keep = (torch.ones_like(chosen, dtype=torch.bool) if capacity_factor is None
                else capacity_keep(chosen, len(experts), capacity(len(x), len(experts), capacity_factor, top_k)))
        out = torch.zeros_like(x)
        for e, expert in enumerate(experts):
            token, slot = torch.nonzero((chosen == e) & keep, as_tuple=True)
            if len(token):
                out = out.index_add(0, token, weights[token, slot].unsqueeze(-1) * expert(x[token]))
        outputs.append(out)
        kept.append(keep)
    return outputs, kept


def switch_aux_loss(probabilities: torch.Tensor, chosen: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Switch Transformer's load-balancing loss, E x sum_e f_e x P_e: f_e the share of the assignments that went to
    expert e (here over all k choices), P_e the mean router probability of expert e. 1.0 when perfectly even."""
    share = nn.functional.one_hot(chosen.reshape(-1), num_experts).float().mean(dim=0)
    return num_experts * (share * probabilities.mean(dim=0)).sum()
