"""What each rank holds and sends for attention over a long sequence: torch's ring attention, keys and values
rotated by all-gather (torch's default) or by all-to-all (a ring), against one process holding the whole sequence.

    torchrun --standalone --nproc-per-node 4 helpers/workers/context_memory.py --seqs 256 512 1024

For each total sequence length S, the ring runs on all N ranks and again on a group of ranks 0 and 1 (N = 2; the
others wait at a barrier), in float32 and in bfloat16. Each rank of a ring takes its contiguous S / N positions of
q, k, v [1, heads, S, head_dim] and runs torch's ring attention forward and backward (no mask;
`_templated_ring_attention` with the CPU flash op, what context_parallel runs), once per rotation method
(set_rotate_method), measuring:
- peak: the largest number of bytes in tensors alive at once during the call, by torch's MemTracker
  (torch.distributed._tools.mem_tracker; it sees tensors, not the scratch memory inside a C++ kernel);
- traffic: every collective and point-to-point op the dispatcher saw (helpers.kit.context_experts.CommCounter), and
  torch's own CommDebugMode's count of the collectives it recognises.
Rank 0 also measures one process with the whole sequence (float32): F.scaled_dot_product_attention forward and
backward. Rank 0's results: rows[i]["N=4 float32 alltoall"] and so on, and rows[i]["one process"].
"""
import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring
from torch.distributed.tensor.experimental._context_parallel import set_rotate_method

from helpers.kit.context_experts import CommCounter
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import progress, result

CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
METHODS = ("allgather", "alltoall")


def inputs(seq: int, heads: int, head_dim: int, rows: slice, dtype: torch.dtype = torch.float32) -> list:
    generator = torch.Generator().manual_seed(0)
    return [torch.randn(1, heads, seq, head_dim, generator=generator)[:, :, rows].to(dtype).contiguous()
            for _ in range(4)]


def torch_ring_step(group, q, k, v, grad) -> None:
    out, lse, *_ = torch_ring._templated_ring_attention(group, 2, CPU_FLASH, q, k, v, is_causal=False)
    torch_ring._templated_ring_attention_backward(group, 2, CPU_FLASH_BACKWARD, grad, "grad_out", q, k, v, out, lse,
                                                  is_causal=False, dropout_p=0.0)


def one_process_step(q, k, v, grad) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    F.scaled_dot_product_attention(q, k, v).backward(grad)


def measure(step, tensors: list[torch.Tensor], rank: int, world_size: int) -> dict:
    """Peak tensor bytes (MemTracker, the inputs counted) and traffic of one call of step(*tensors)."""
    comms, counts = CommCounter(rank, world_size), CommDebugMode()
    tracker = MemTracker()
    tracker.track_external(*tensors)
    with tracker, comms, counts:
        step(*tensors)
    peak = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"]
    events = comms.take()
    return {"peak": peak, "sent": sum(e["sent"] for e in events), "events": events,
            "debug_counts": {str(op): n for op, n in counts.get_comm_counts().items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=16)
    args = parser.parse_args()
    rank, world_size, _ = init_distributed("gloo")  # CPU tensors and the CPU flash op: gloo on any machine
    pair = dist.new_group([0, 1])  # every rank must call new_group; only ranks 0 and 1 use it
    groups = {world_size: dist.group.WORLD, 2: pair} if world_size > 2 else {world_size: dist.group.WORLD}
    torch_ring._cp_options.enable_load_balance = False  # contiguous chunks, no mask
    rows = []
    for done, seq in enumerate(args.seqs):
        row = {"seq": seq}
        for n, group in groups.items():
            if rank < n:
                share = seq // n
                for name, dtype in DTYPES.items():
                    local = inputs(seq, args.heads, args.head_dim, slice(rank * share, (rank + 1) * share), dtype)
                    kv_bytes = 2 * local[1].numel() * local[1].element_size()
                    for method in METHODS:
                        set_rotate_method(method)
                        row[f"N={n} {name} {method}"] = {
                            **measure(lambda *t, group=group: torch_ring_step(group, *t), local, rank, n),
                            "kv_bytes": kv_bytes, "local_tokens": share, "ranks": n}
            dist.barrier()
        if rank == 0:
            row["one process"] = measure(one_process_step, inputs(seq, args.heads, args.head_dim, slice(None)), 0, 1)
        rows.append(row)
        progress(done + 1, len(args.seqs))
    set_rotate_method("allgather")  # torch's defaults
    torch_ring._cp_options.enable_load_balance = True
    result(rows=rows, heads=args.heads, head_dim=args.head_dim, sizes=sorted(groups))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
