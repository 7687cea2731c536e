"""The real run of lesson 11's twin: lesson 10's transformer, tensor-parallel with sequence parallelism, on gloo.

    torchrun --standalone --nproc-per-node 2 helpers/workers/scale_twin.py --steps 2

Every rank builds the same model (seed 0), shards it over a 1-D mesh of all ranks with lesson 10's plan
(helpers.kit.transformer.apply_tp) and trains it on the same global batch (tensor parallelism splits the model, not
the data). helpers.kit.scale.tp_record runs the steps, the same function the notebook runs under LocalTensorMode.
Each rank hands back, per step, its loss, and its local gradients and parameters as exact float lists; every
module's output in the first forward; and
CommDebugMode's count of the first step's collectives; and
what all_reduce and reduce_scatter give for four values whose float32 sum depends on the order of addition.
CPU and gloo only, also where GPUs exist (see main). Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import report, result
from helpers.kit.scale import order_probe, tp_record
from helpers.kit.transformer import batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=4)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    args = parser.parse_args()

    # gloo and the CPU, also where GPUs exist: the notebook's twin runs on the CPU, so a bitwise compare is only
    # meaningful against CPU kernels (cuBLAS would differ), and on a one-GPU machine rank 1 would ask for cuda:1.
    rank, world_size, device = init_distributed("gloo")
    mesh = init_device_mesh(device.type, (world_size,))
    batches = [tuple(t.to(device) for t in batch(step, args.global_batch)) for step in range(args.steps)]
    record = tp_record(mesh, batches, sequence_parallel=not args.no_sequence_parallel, count_first_step=True)
    for step, entry in enumerate(record):
        report(step=step, loss=entry["loss"].item())
    # float32 -> Python float -> JSON -> float32 is exact, so the notebook can compare bit for bit.
    # The control: the four ORDER_PROBE values (helpers/lessons/scale.py) summed by this backend.
    probe_values = (2.0**24, 1.0, -(2.0**24), 1.0)
    probe = order_probe(torch.full((world_size,), probe_values[rank % 4], device=device))
    result(comm_counts=record[0]["comm_counts"],  # CommDebugMode's count of the first step on this real group
           order_probe={name: t.cpu().tolist() for name, t in probe.items()},
           outputs={name: t.cpu().tolist() for name, t in record[0]["outputs"].items()},
           steps=[{"loss": entry["loss"].item(),
                   "grads": {name: t.cpu().tolist() for name, t in entry["grads"].items()},
                   "params": {name: t.cpu().tolist() for name, t in entry["params"].items()}} for entry in record])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
