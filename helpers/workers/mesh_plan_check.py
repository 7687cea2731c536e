"""Try a tensor-parallel plan for Llama's gated MLP block on two ranks, against the same block in one process.

    torchrun --standalone --nproc-per-node 2 helpers/workers/mesh_plan_check.py notebooks/my_mlp_plan.py [MORE.py ...]

The plan file defines PLAN, the dict parallelize_module takes for helpers.kit.transformer.GatedFeedForward,
w2(silu(w1 x) * w3 x) ({"w1": ..., "w2": ..., "w3": ...}). Every rank builds the same block and input (seed 0),
keeps a plain copy, applies
PLAN on a 1-D mesh of all ranks and runs forward and backward under CommDebugMode. The input requires grad, as
it does inside the model (it is the output of the norm before the block), so backward computes its gradient
too. It reports each weight's placements and local shape, the collectives of forward and of backward, and how
far the output, the weights' gradients and the input's gradient are from the plain copy's; or, if torch refuses
the plan, the error's last line. Several plan files are tried one after another in one launch.
"""
import argparse
import copy
import runpy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import parallelize_module

from helpers.kit import transformer
from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def max_abs_diff(first: list[torch.Tensor], second: list[torch.Tensor]) -> float:
    return max((a - b).abs().max().item() for a, b in zip(first, second, strict=True))


LAYERS = ("w1", "w3", "w2")


def try_plan(plan: dict, mesh, block: transformer.GatedFeedForward, x: torch.Tensor) -> dict:
    plain, x_plain = copy.deepcopy(block), x.detach().clone().requires_grad_()
    expected = plain(x_plain)
    expected.sum().backward()
    parallelize_module(block, mesh, plan)
    running: list[str] = []  # the layers whose forward has begun and not ended: on an error, the last is where

    def ended(module, args, output) -> None:  # returns None: the output stays as it is
        running.pop()

    for name in LAYERS:
        layer = getattr(block, name)
        layer.register_forward_pre_hook(lambda module, args, name=name: running.append(name) or None, prepend=True)
        layer.register_forward_hook(ended)  # registered after the plan's own output hook, so it runs after it
    counts = {}
    with CommDebugMode() as forward:
        try:
            y = block(x)
        except Exception as error:
            error.layer = running[-1] if running else None  # read by main()
            raise
    with CommDebugMode() as backward:
        y.sum().backward()
    for phase, mode in (("forward", forward), ("backward", backward)):
        counts[phase] = {str(op).split(".")[-1]: n for op, n in mode.get_comm_counts().items()}
    y = whole(y)
    report = {"weights": {name: {"placements": [repr(p) for p in getattr(layer.weight, "placements", [])],
                                 "local_shape": list(getattr(layer.weight, "_local_tensor", layer.weight).shape)}
                          for name, layer in ((name, getattr(block, name)) for name in LAYERS)},
              "collectives": counts, "output_shape": list(y.shape), "expected_shape": list(expected.shape)}
    if y.shape == expected.shape:
        report["output_diff"] = max_abs_diff([y], [expected])
        if x.grad is None:  # the plan cut the input off from backward
            report["grad_diff"] = float("inf")
        else:
            ours = [whole(getattr(block, name).weight.grad) for name in LAYERS] + [whole(x.grad)]
            expected_grads = [getattr(plain, name).weight.grad for name in LAYERS] + [x_plain.grad]
            report["grad_diff"] = max_abs_diff(ours, expected_grads)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", help="Python files that define PLAN (each tried on a fresh block)")
    args = parser.parse_args()
    _, world_size, device = init_distributed()
    mesh = init_device_mesh(device.type, (world_size,), mesh_dim_names=("tp",))
    reports = []
    for path in args.plans:
        plan = runpy.run_path(path)["PLAN"]  # an error in the plan file itself fails the launch, naming its line
        torch.manual_seed(0)  # every rank: the same block and the same input
        block = transformer.GatedFeedForward(transformer.DIM, transformer.HIDDEN).to(device)
        # requires_grad: inside the model the block's input has a gradient to compute (as the norm's output does),
        # which costs each column-wise layer an all-reduce in backward; a leaf without grad would hide it.
        x = torch.randn(2, transformer.SEQ, transformer.DIM, device=device, requires_grad=True)
        try:
            reports.append(try_plan(plan, mesh, block, x))
        except Exception as error:  # every rank fails the same way, before any collective it would wait in
            reports.append({"error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1]}",
                            "layer": getattr(error, "layer", None)})
    result(reports=reports)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
