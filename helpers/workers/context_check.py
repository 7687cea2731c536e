"""Lesson 12's check of ring attention: the learner's (or our) ring beside one-process attention and torch's own ring.

    torchrun --standalone --nproc-per-node 4 helpers/workers/context_check.py --impl solution --causal

--impl: one or more files, each with `ring_attention(q, k, v, layout, causal)` (notebooks/my_ring_attention.py), or
`solution` (context_ring_solution.py). For each file and each chunk layout (contiguous: rank r holds chunk r;
balanced: chunks r and 2N-1-r), every rank builds the same q, k, v [1, 2, 8N, 8] (fp32, seed 0) and an output
gradient, takes its own positions, and runs:
- one-process attention, F.scaled_dot_product_attention on the whole sequence (is_causal as asked): the truth;
- torch's own ring attention, `_templated_ring_attention` with the CPU flash op, and its backward (load balancing on
  for the balanced causal layout, off otherwise);
- the file's ring_attention, forward then backward, under FlopCounterMode (FLOPs), our CommCounter (every
  collective and point-to-point op the dispatcher sees, with the bytes that leave this rank) and our HeldReceives
  (every irecv's buffer holds NaN until its request's wait(); the receives never waited for are counted).
Each rank hands back the largest differences, the FLOPs, the traffic, and which simulated mistake (if any) its output
matches (helpers.kit.context_experts.simulated_ring). helpers/lessons/context_experts.py decides.
With one file, an exception in it stops the launch (the check names the rank and the line); with several (tests),
each file's exception is recorded and the next file runs, so only files whose ranks fail alike may share a launch.
"""
import argparse
import importlib.util
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as torch_ring

from helpers.kit.context_experts import (
    LABEL_OFF_BY,
    LAYOUTS,
    MISTAKES,
    CommCounter,
    HeldReceives,
    block_flops,
    expected_work,
    flop_counter,
    layout,
    positions,
    simulated_ring,
)
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result

BATCH, HEADS, HEAD_DIM, ROWS_PER_RANK = 1, 2, 8, 8
MATCH = 1e-5  # a simulated output "matches" within this


def load(impl: str):
    path = Path(__file__).with_name("context_ring_solution.py") if impl == "solution" else Path(impl)
    spec = importlib.util.spec_from_file_location(f"ring_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def data(world_size: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    shape = (BATCH, HEADS, ROWS_PER_RANK * world_size, HEAD_DIM)
    return {name: torch.randn(shape, generator=generator) for name in ("q", "k", "v", "grad_out")}


def attention_rows(full: dict, rows: torch.Tensor, causal: bool,
                   dtype: torch.dtype = torch.float64) -> dict[str, torch.Tensor]:
    """Attention of the queries at `rows` over every key (a causal mask by sequence position): the output and the
    gradients its output gradient gives to q (those rows), k and v (every row). In float64 by default, from the same
    float32 inputs: the truth, with float32's rounding (about 1e-7 of each value) left to the ring under test."""
    q, k, v = (full[n].to(dtype).requires_grad_() for n in ("q", "k", "v"))
    seq = q.shape[2]
    mask = None if not causal else (rows.unsqueeze(1) >= torch.arange(seq).unsqueeze(0))
    out = F.scaled_dot_product_attention(q[:, :, rows], k, v, attn_mask=mask)
    out.backward(full["grad_out"][:, :, rows].to(dtype))
    return {"out": out.detach(), "q": q.grad[:, :, rows], "k": k.grad, "v": v.grad}


def torch_ring_attention(local: dict, causal: bool, balanced: bool) -> dict[str, torch.Tensor]:
    """torch's own ring attention and its backward on this rank's chunks (what context_parallel runs on GPUs)."""
    torch_ring._cp_options.enable_load_balance = causal and balanced
    try:
        with flop_counter() as flops:
            out, lse, *_ = torch_ring._templated_ring_attention(
                dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
                local["q"], local["k"], local["v"], is_causal=causal)
        forward_flops = flops.get_total_flops()
        grad_q, grad_k, grad_v, *_ = torch_ring._templated_ring_attention_backward(
            dist.group.WORLD, 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
            local["grad_out"], "grad_out", local["q"], local["k"], local["v"], out, lse, is_causal=causal,
            dropout_p=0.0)
    finally:
        torch_ring._cp_options.enable_load_balance = True  # torch's default
    return {"out": out, "q": grad_q, "k": grad_k, "v": grad_v, "flops": forward_flops}


def largest(a: torch.Tensor, b: torch.Tensor) -> float:
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return float("inf")
    return float((a.double() - b.double()).abs().max()) if not torch.isnan(a).any() else float("nan")


def run_learner(module, local: dict, chunk_layout: list, causal: bool, rank: int, world_size: int) -> dict:
    q, k, v = (local[n].clone().requires_grad_() for n in ("q", "k", "v"))
    comms = CommCounter(rank, world_size)
    with HeldReceives() as held:  # an irecv's buffer holds NaN until its wait(): a read before it fails every run
        with flop_counter() as flops, comms:
            out = module.ring_attention(q, k, v, chunk_layout, causal)
        forward = {"flops": flops.get_total_flops(), "events": comms.take(), "unwaited": held.unwaited()}
        got = {"forward": forward, "shape": list(out.shape) if isinstance(out, torch.Tensor) else repr(type(out))}
        if not isinstance(out, torch.Tensor) or out.shape != q.shape or not out.requires_grad:
            got["out"] = out if isinstance(out, torch.Tensor) else None
            got["backward_error"] = "no output to differentiate" if not isinstance(out, torch.Tensor) else (
                "the output does not require grad" if not out.requires_grad else "wrong shape")
            return got
        with flop_counter() as flops, comms:
            out.backward(local["grad_out"])
        got["backward"] = {"flops": flops.get_total_flops(), "events": comms.take(),
                           "unwaited": held.unwaited() - forward["unwaited"]}
    got.update(out=out.detach(), q=q.grad, k=k.grad, v=v.grad)
    return got


def grade(module, kind: str, causal: bool, rank: int, world_size: int) -> dict:
    full = data(world_size)
    chunk_layout = layout(kind, world_size)
    n_chunks = sum(len(row) for row in chunk_layout)
    seq = full["q"].shape[2]
    rows = positions(chunk_layout[rank], seq, n_chunks)
    local = {name: t[:, :, rows].contiguous() for name, t in full.items()}
    truth = attention_rows(full, rows, causal)
    want = {"out": truth["out"], "q": truth["q"]}
    everyone = attention_rows(full, torch.arange(seq), causal)
    want["k"], want["v"] = everyone["k"][:, :, rows], everyone["v"][:, :, rows]
    theirs = torch_ring_attention(local, causal, kind == "balanced")
    got = run_learner(module, local, chunk_layout, causal, rank, world_size)
    report = {"layout": chunk_layout, "rows": rows.tolist(), "shape": got["shape"], "want_shape": list(rows.shape),
              "forward": got["forward"], "backward": got.get("backward"), "backward_error": got.get("backward_error"),
              "torch_flops": theirs["flops"], "torch_vs_truth": {n: largest(theirs[n], want[n]) for n in want},
              "chunk_rows": seq // n_chunks, "expected": expected_work(chunk_layout, causal)[rank],
              "block_flops": block_flops(BATCH, HEADS, seq // n_chunks, HEAD_DIM)}
    report["vs_truth"] = {n: largest(got.get(n), want[n]) for n in want}
    report["vs_torch"] = {n: largest(got.get(n), theirs[n]) for n in want}
    report["matches"] = diagnose(got, full, chunk_layout, causal, rank, rows, want)
    return report


def diagnose(got: dict, full: dict, chunk_layout: list, causal: bool, rank: int, rows: torch.Tensor,
             want: dict) -> dict:
    """Which wrong answers the learner's tensors equal: a simulated mistake of the forward ring, a ring stopped
    early, and for dk, dv: another rank's gradient, or only this rank's own queries' share."""
    found: dict = {"mistakes": [], "steps": None, "k_owner": None, "own_share_only": False}
    out = got.get("out")
    if not isinstance(out, torch.Tensor) or out.shape != want["out"].shape:
        return found
    world_size = len(chunk_layout)
    q, k, v = full["q"], full["k"], full["v"]
    for mistake in MISTAKES:
        for label_off in (LABEL_OFF_BY if mistake == "block labelled one step off" else (None,)):
            if largest(out, simulated_ring(q, k, v, chunk_layout, causal, mistake, label_off=label_off)[rank]) < MATCH:
                found["mistakes"].append(mistake)
                break
    for steps in range(1, world_size):
        if largest(out, simulated_ring(q, k, v, chunk_layout, causal, steps=steps)[rank]) < MATCH:
            found["steps"] = steps
            break
    if largest(out, want["out"]) < MATCH and isinstance(got.get("k"), torch.Tensor):
        n_chunks = sum(len(r) for r in chunk_layout)
        everyone = attention_rows(full, torch.arange(q.shape[2]), causal)["k"]
        for other in range(world_size):
            if other != rank and largest(got["k"], everyone[:, :, positions(chunk_layout[other], q.shape[2],
                                                                           n_chunks)]) < MATCH:
                found["k_owner"] = other
        own = attention_rows(full, rows, causal)["k"][:, :, rows]
        found["own_share_only"] = largest(got["k"], own) < MATCH
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["solution"])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    args = parser.parse_args()
    rank, world_size, _ = init_distributed("gloo")  # CPU tensors and the CPU flash op: gloo on any machine
    graded = {}
    for impl in args.impl:
        try:
            module = load(impl)
            graded[impl] = {kind: grade(module, kind, args.causal, rank, world_size) for kind in args.layouts}
        except Exception as error:
            if len(args.impl) == 1:
                raise
            graded[impl] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        dist.barrier()
    result(world_size=world_size, causal=args.causal, graded=graded)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
