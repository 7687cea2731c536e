"""Time causal ring attention (forward and backward) with contiguous chunks against balanced chunks.

    torchrun --standalone --nproc-per-node 2 helpers/workers/context_balance.py --impl notebooks/my_ring_attention.py

--impl: a file with `ring_attention(q, k, v, layout, causal)` that passed lesson 12's causal check. Both layouts take
turns, in a shuffled order each round, after a warm-up, with a barrier before every turn
(helpers.kit.timing.take_turns). Each rank hands back its own wall and CPU seconds per round, and the FLOPs of its
forward (FlopCounterMode): a step is as slow as its slowest rank, and a rank's CPU seconds count the work it did itself
(and whatever its waiting costs).
"""
import argparse
import importlib.util
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.kit.context_experts import LAYOUTS, flop_counter, layout, positions
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result
from helpers.kit.timing import take_turns


def load(impl: str):
    spec = importlib.util.spec_from_file_location("ring_under_test", Path(impl))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", required=True)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rank, world_size, _ = init_distributed("gloo")  # CPU tensors: gloo on any machine
    ring = load(args.impl).ring_attention
    generator = torch.Generator().manual_seed(0)
    full = [torch.randn(1, args.heads, args.seq, args.head_dim, generator=generator) for _ in range(4)]
    steps, flops = {}, {}
    for kind in LAYOUTS:
        chunk_layout = layout(kind, world_size)
        rows = positions(chunk_layout[rank], args.seq, sum(len(r) for r in chunk_layout))
        q, k, v, grad = (t[:, :, rows].contiguous() for t in full)

        def step(q=q, k=k, v=v, grad=grad, chunk_layout=chunk_layout):
            q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
            ring(q, k, v, chunk_layout, True).backward(grad)

        with flop_counter() as counter:
            ring(q, k, v, chunk_layout, True)
        flops[kind] = counter.get_total_flops()
        steps[kind] = step
    if rank == 0:
        print(f"timing {', '.join(steps)} on {world_size} ranks: {args.rounds} rounds after 2 warm-up rounds",
              flush=True)
    timings = take_turns(steps, rounds=args.rounds, warmup=2, between=dist.barrier)
    result(timings={name: t.as_dict() for name, t in timings.items()}, flops=flops, seq=args.seq,
           heads=args.heads, head_dim=args.head_dim)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
