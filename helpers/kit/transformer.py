"""Worker kit: lesson 10's small transformer, its one-process reference step, and three ways to lay it out.

    from helpers.kit.transformer import Transformer, apply_fsdp, apply_fsdp_tp, apply_hsdp, batch, reference_losses
    model = Transformer(seed=0)                      # the same weights in every process
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    apply_fsdp_tp(model, mesh)

The model follows torchtitan's Llama layout and module names (torchtitan/models/llama3/model/model.py) at
toy size: token embedding, blocks of RMSNorm -> causal self-attention -> residual, RMSNorm -> MLP -> residual,
a final RMSNorm and an output Linear. Simpler than Llama: the MLP is w2(silu(w1 x)) without Llama's gate w3,
no position encoding (causal attention alone), no dropout; fp32, so that every layout can be compared with
one process. The layouts are after torchtitan's
`parallelize_llama` (torchtitan/models/llama3/infra/parallelize.py), simplified: TP plan first, FSDP on top, as
there; but FSDP units are each block plus the root (torchtitan also wraps tok_embeddings alone and
[norm, output] together), the logits are all-gathered (torchtitan's default loss_parallel keeps them sharded,
Shard(-1)), and there is no w3 or q_norm/k_norm to plan for.

This module has no launch or file code: lessons 10 and 11 build their workers on it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

VOCAB, DIM, HEADS, HIDDEN, BLOCKS, SEQ = 256, 64, 4, 256, 2, 32


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch_size, seq = x.shape[:2]
        # -1, not `heads`: under tensor parallelism each rank holds only its share of the heads.
        q, k, v = (w(x).view(batch_size, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch_size, seq, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)))


class GatedFeedForward(nn.Module):
    """Llama's MLP, w2(silu(w1 x) * w3 x): the gate w3 is what lesson 10's model leaves out. Lesson 10's first
    exercise writes its tensor-parallel plan (helpers/workers/mesh_plan_check.py)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """Token ids [batch, seq] -> logits [batch, seq, vocab]. Same seed, same weights, in any process."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, heads: int = HEADS, hidden: int = HIDDEN,
                 blocks: int = BLOCKS, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): Block(dim, heads, hidden) for i in range(blocks)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x))


def batch(step: int, batch_size: int, seq: int = SEQ, vocab: int = VOCAB,
          seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s (inputs, targets), the same in every process: sequences that count up by a random
    stride from a random start (mod vocab), so that the loss can fall. Each rank takes its own rows."""
    generator = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(vocab, (batch_size, 1), generator=generator)
    stride = torch.randint(1, 8, (batch_size, 1), generator=generator)
    sequence = (start + stride * torch.arange(seq + 1)) % vocab
    return sequence[:, :-1], sequence[:, 1:]


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW; foreach=False so that the one-process and DTensor updates run the same per-tensor kernels."""
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, foreach=False)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, inputs: torch.Tensor,
               targets: torch.Tensor) -> torch.Tensor:
    """One step; returns this process's loss (the mean over its rows), detached."""
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.detach()


def reference_losses(steps: int, global_batch: int, seed: int = 0) -> list[float]:
    """The one-process run every layout is compared with: the whole global batch in one process."""
    model = Transformer(seed=seed)
    optimizer = make_optimizer(model)
    return [train_step(model, optimizer, *batch(step, global_batch, seed=seed)).item() for step in range(steps)]


def rows(inputs: torch.Tensor, index: int, count: int) -> torch.Tensor:
    """Data-parallel rank `index` of `count` takes its contiguous share of the global batch's rows."""
    share = inputs.shape[0] // count
    return inputs[index * share:(index + 1) * share]


def apply_fsdp(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """FSDP2 over a 1-D mesh: each block is a unit, then the root (embedding, final norm, output).
    The root keeps its parameters gathered from forward to backward by default (see the lesson)."""
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def apply_hsdp(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """HSDP: a 2-D mesh (replicate, shard) given to fully_shard replicates across dim 0, shards across dim 1."""
    if mesh.ndim != 2:
        raise ValueError(f"HSDP needs a 2-D mesh (replicate, shard), got {mesh.ndim}-D")
    return apply_fsdp(model, mesh)


def tp_plan(sequence_parallel: bool = True) -> tuple[dict, dict]:
    """After torchtitan's plan, without loss parallel (logits Replicate): (top-level plan, plan for each block).

    With sequence_parallel the norms and residual stream are sharded along the sequence (Shard(1)) between
    the attention and MLP; each block then all-gathers its input and reduce-scatters its output, instead of
    all-reducing it."""
    if not sequence_parallel:
        top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
               "output": ColwiseParallel(output_layouts=Replicate())}
        block = {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                 "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
                 "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel()}
        return top, block
    top = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
           "norm": SequenceParallel(),
           "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
    block = {"attention_norm": SequenceParallel(),
             "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
             "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
             "ffn_norm": SequenceParallel(),
             "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
             "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}
    return top, block


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = True) -> Transformer:
    """Tensor parallelism over a 1-D mesh, with tp_plan: after torchtitan's plan, simplified."""
    top, block_plan = tp_plan(sequence_parallel)
    parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan)
    return model


def apply_fsdp_tp(model: Transformer, mesh: DeviceMesh, sequence_parallel: bool = True) -> Transformer:
    """2-D: tensor parallelism over mesh["tp"], then FSDP over mesh["dp"] (TP first, as torchtitan does)."""
    apply_tp(model, mesh["tp"], sequence_parallel)
    return apply_fsdp(model, mesh["dp"])
