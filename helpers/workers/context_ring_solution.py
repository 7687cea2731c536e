"""Lesson 12's answer to exercises 1 to 3: ring attention, forward and backward, with and without a causal mask.

    torchrun --standalone --nproc-per-node 2 helpers/workers/context_check.py --impl solution

Each rank holds the chunks `layout[rank]` of the sequence (queries, keys and values of those positions). Keys and
values travel around the ring: at step s a rank holds the block of rank (rank - s) mod N, sends it on to
rank + 1 and receives the next one from rank - 1 while it computes. Partial attentions merge by the log-sum-exp
rule. Backward runs the ring again: the gradients of a block's keys and values travel with the block and, after
one last pass, come home to the rank that owns it. After picotron's RingAttentionFunc
(picotron/context_parallel/context_parallel.py), with any chunk layout.
"""
import torch
import torch.distributed as dist

from helpers.kit.context_experts import block_attention, block_attention_backward


def merge(out, lse, block_out, block_lse):
    """Two partial attentions of the same queries over disjoint keys -> the attention over all of them."""
    new_lse = torch.logaddexp(lse, block_lse)  # log(exp(lse) + exp(block_lse)), without overflow
    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out
    return out, new_lse


def needed(mine, theirs, causal):
    """(i, j, diagonal): my query chunk i meets their key chunk j; skip blocks whose keys all come later."""
    for i, a in enumerate(mine):
        for j, b in enumerate(theirs):
            if not causal or b < a:
                yield i, j, False
            elif b == a:
                yield i, j, True


def pass_on(tensor):
    """Start sending `tensor` to the next rank and receiving the previous rank's into a new tensor."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    received = torch.empty_like(tensor)
    requests = [dist.isend(tensor, (rank + 1) % world_size), dist.irecv(received, (rank - 1) % world_size)]
    return received, requests


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, causal):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = layout[rank]
        queries = q.chunk(len(mine), dim=2)
        outs, lses = [None] * len(mine), [None] * len(mine)
        kv = torch.stack([k, v])
        for step in range(world_size):
            if step < world_size - 1:
                incoming, requests = pass_on(kv)  # the next block travels while this one is computed
            theirs = layout[(rank - step) % world_size]
            keys, values = kv[0].chunk(len(theirs), dim=2), kv[1].chunk(len(theirs), dim=2)
            for i, j, diagonal in needed(mine, theirs, causal):
                block_out, block_lse = block_attention(queries[i], keys[j], values[j], diagonal)
                if outs[i] is None:
                    outs[i], lses[i] = block_out, block_lse
                else:
                    outs[i], lses[i] = merge(outs[i], lses[i], block_out, block_lse)
            if step < world_size - 1:
                for request in requests:
                    request.wait()
                kv = incoming
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.layout, ctx.causal = layout, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = ctx.layout[rank]
        n = len(mine)
        queries, outs, lses, grads = (t.chunk(n, dim=2) for t in (q, out, lse, grad_out.contiguous()))
        grad_q = torch.zeros_like(q)
        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # k, v, dk, dv
        for step in range(world_size):
            theirs = ctx.layout[(rank - step) % world_size]
            keys, values, grad_k, grad_v = (t.chunk(len(theirs), dim=2) for t in travelling)
            for i, j, diagonal in needed(mine, theirs, ctx.causal):
                dq, dk, dv = block_attention_backward(queries[i], keys[j], values[j], outs[i], lses[i], grads[i],
                                                      diagonal)
                grad_q.chunk(n, dim=2)[i].add_(dq)
                grad_k[j].add_(dk)  # views into `travelling`: the gradients ride along with their block
                grad_v[j].add_(dv)
            # after the last step only dk and dv still travel: one more pass brings them home
            incoming, requests = pass_on(travelling if step < world_size - 1 else travelling[2:].contiguous())
            for request in requests:
                request.wait()
            travelling = incoming
        return grad_q, travelling[-2], travelling[-1], None, None


def ring_attention(q, k, v, layout, causal=False):
    """Attention of this rank's queries over the whole sequence. q, k, v: [batch, heads, local tokens, head dim],
    this rank's chunks layout[rank] in that order. Returns this rank's output, the shape of q."""
    return RingAttention.apply(q, k, v, layout, causal)
