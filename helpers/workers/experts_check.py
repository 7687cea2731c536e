"""Lesson 12's check of expert parallelism: the learner's (or our) MoE layer beside the same layer in one process.

    torchrun --standalone --nproc-per-node 2 helpers/workers/experts_check.py --impl solution

--impl: one or more files, each with a class `ExpertParallelMoE(router, experts, num_experts, top_k,
capacity_factor)` (notebooks/my_moe.py), or `solution` (experts_moe_solution.py). Every rank builds the same router
and 4 experts (helpers.kit.context_experts.build_moe, seed 0), keeps experts rank*E/N ... of them, and its own 16
tokens. For capacity factor None (nothing dropped) and then 1.0, it runs the class forward and backward under our
CommCounter, and compares with reference_moe, the whole layer in one process (each rank's tokens one group, capacity
applied within it): the outputs, which assignments were kept, and the gradients of the tokens, the router (this
rank's tokens' share) and this rank's experts (every rank's tokens' share). Each rank hands back the largest
differences, the kept masks, the traffic, and which wrong layer (if any) its output equals. Decided in
helpers/lessons/context_experts.py. One file: an exception stops the launch (the check names the rank and the line);
several (tests): each file's exception is recorded, so only files whose ranks fail alike may share a launch.
"""
import argparse
import copy
import importlib.util
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from helpers.kit.context_experts import (
    MOE_TOKENS,
    NUM_EXPERTS,
    TOP_K,
    CommCounter,
    build_moe,
    capacity,
    capacity_keep,
    moe_tokens,
    reference_moe,
    route,
)
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result

TOKENS = MOE_TOKENS
CAPACITY_FACTORS = (None, 1.0)
MATCH = 1e-5


def load(impl: str):
    path = Path(__file__).with_name("experts_moe_solution.py") if impl == "solution" else Path(impl)
    spec = importlib.util.spec_from_file_location(f"moe_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ExpertParallelMoE


def reference(capacity_factor, rank: int, world_size: int) -> dict:
    """The one-process layer: outputs, kept, and the gradients each rank should end with."""
    router, experts = build_moe()
    groups, grads = moe_tokens(world_size)
    groups = [g.clone().requires_grad_() for g in groups]
    outputs, kept = reference_moe(groups, router, experts, TOP_K, capacity_factor)
    sum((o * g).sum() for o, g in zip(outputs, grads, strict=True)).backward()
    local = NUM_EXPERTS // world_size
    mine = experts[rank * local:(rank + 1) * local]
    router_share = torch.autograd.grad(reference_moe([groups[rank].detach()], router, experts, TOP_K,
                                                     capacity_factor)[0][0].mul(grads[rank]).sum(), router.weight)[0]
    return {"out": outputs[rank].detach(), "kept": kept[rank], "x": groups[rank].grad, "router": router_share,
            "experts": [p.grad for p in mine.parameters()]}


def wrong_layers(capacity_factor, rank: int, world_size: int) -> dict[str, torch.Tensor]:
    """This rank's output from layers a learner might build by mistake, in one process."""
    router, experts = build_moe()
    groups, _ = moe_tokens(world_size)
    x = groups[rank]
    local = NUM_EXPERTS // world_size
    # a rank that sends expert e's tokens to rank e % N, whose local expert e // N runs them
    swapped = torch.nn.ModuleList(experts[(e % world_size) * local + e // world_size] for e in range(NUM_EXPERTS))
    layers = {"wrong expert": reference_moe([x], router, swapped, TOP_K, capacity_factor)[0][0]}
    chosen, weights, _ = route(x, router, TOP_K)
    keep = (torch.ones_like(chosen, dtype=torch.bool) if capacity_factor is None
            else capacity_keep(chosen, NUM_EXPERTS, capacity(TOKENS, NUM_EXPERTS, capacity_factor)))
    unweighted = torch.zeros_like(x)
    for e, expert in enumerate(experts):
        token, _ = torch.nonzero((chosen == e) & keep, as_tuple=True)
        unweighted = unweighted.index_add(0, token, expert(x[token]))
    layers["unweighted"] = unweighted
    own = torch.zeros_like(x)  # the starting code: only the choices that are this rank's own experts
    for e in range(rank * local, (rank + 1) * local):
        token, slot = torch.nonzero((chosen == e) & keep, as_tuple=True)
        own = own.index_add(0, token, weights[token, slot].unsqueeze(-1) * experts[e](x[token]))
    layers["own experts only"] = own
    twice, before = torch.zeros_like(x), torch.zeros_like(x)  # the router's weight on the rows before the experts
    for e, expert in enumerate(experts):
        token, slot = torch.nonzero((chosen == e) & keep, as_tuple=True)
        gate = weights[token, slot].unsqueeze(-1)
        twice = twice.index_add(0, token, gate * expert(gate * x[token]))  # ... and on their results again
        before = before.index_add(0, token, expert(gate * x[token]))  # ... and not on their results
    layers["gate applied twice"], layers["gate before the experts"] = twice, before
    return {name: out.detach() for name, out in layers.items()}


def largest(a, b) -> float:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape != b.shape:
        return float("inf")
    return float((a.detach() - b).abs().max())


def grade(cls, capacity_factor, rank: int, world_size: int) -> dict:
    want = reference(capacity_factor, rank, world_size)
    router, experts = build_moe()
    local = NUM_EXPERTS // world_size
    mine = copy.deepcopy(experts[rank * local:(rank + 1) * local])
    groups, grads = moe_tokens(world_size)
    x = groups[rank].clone().requires_grad_()
    layer = cls(router, mine, NUM_EXPERTS, TOP_K, capacity_factor)
    comms = CommCounter(rank, world_size)
    with comms:
        out = layer(x)
    forward = comms.take()
    report = {"capacity_factor": capacity_factor, "forward": forward, "tokens": TOKENS,
              "shape": list(out.shape) if isinstance(out, torch.Tensor) else repr(type(out)),
              "limit": None if capacity_factor is None else capacity(TOKENS, NUM_EXPERTS, capacity_factor),
              "want_kept": want["kept"].tolist(), "expert_bytes": sum(p.numel() * p.element_size()
                                                                      for p in mine.parameters())}
    kept = getattr(layer, "kept", None)
    report["kept"] = kept.tolist() if isinstance(kept, torch.Tensor) and kept.shape == want["kept"].shape else None
    report["out"] = largest(out, want["out"])
    report["matches"] = [name for name, wrong in wrong_layers(capacity_factor, rank, world_size).items()
                         if largest(out, wrong) < MATCH]
    if not isinstance(out, torch.Tensor) or not out.requires_grad:
        report["backward_error"] = "no output" if not isinstance(out, torch.Tensor) else "no grad"
        return report
    with comms:
        out.backward(grads[rank])
    report["backward"] = comms.take()
    report["x"] = largest(x.grad, want["x"])
    report["router"] = largest(router.weight.grad, want["router"])
    report["experts"] = max(largest(p.grad, w) for p, w in zip(mine.parameters(), want["experts"], strict=True))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impl", nargs="+", default=["solution"])
    args = parser.parse_args()
    rank, world_size, _ = init_distributed("gloo")  # CPU tensors: gloo on any machine
    if NUM_EXPERTS % world_size:
        raise SystemExit(f"{NUM_EXPERTS} experts do not split over {world_size} ranks: use 1, 2 or 4 processes")
    graded = {}
    for impl in args.impl:
        try:
            cls = load(impl)
            graded[impl] = {str(factor): grade(cls, factor, rank, world_size) for factor in CAPACITY_FACTORS}
        except Exception as error:
            if len(args.impl) == 1:
                raise
            graded[impl] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}
        dist.barrier()
    result(world_size=world_size, graded=graded)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
