"""A 2 x 2 DeviceMesh over four processes: who shares each dimension's group, and what a DTensor leaves on each rank.

    torchrun --standalone --nproc-per-node 4 helpers/workers/mesh_tour.py

init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) lays the ranks out row by row:
[[0, 1], [2, 3]]. Each rank reports its coordinate, the ranks of the process group of each dimension
(from the groups themselves, dist.get_process_group_ranks), and, for one 4 x 4 tensor laid out with
several placements, the local piece it holds (to_local) and the whole it stands for (full_tensor).
Also runs under two torchrun agents of two workers each (--nnodes 2), as lesson 00 does. Needs 4 ranks.
"""
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from helpers.kit.distributed import init_distributed
from helpers.kit.reporting import result


def main() -> None:
    _, world_size, device = init_distributed()
    if world_size != 4:
        raise SystemExit(f"this worker builds a 2 x 2 mesh: start it with 4 processes, not {world_size}")
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=("dp", "tp"))
    groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in mesh.mesh_dim_names}

    whole = torch.arange(16, dtype=torch.float32, device=device).reshape(4, 4)  # the same on every rank
    pieces = {}
    for placements in ([Shard(0), Replicate()], [Shard(0), Shard(1)], [Replicate(), Shard(0)]):
        laid_out = distribute_tensor(whole, mesh, placements)
        pieces[repr(tuple(placements))] = {"local": laid_out.to_local(), "full": laid_out.full_tensor()}
    # Partial along tp: each rank holds a term of a sum; nothing is added until someone asks for the whole.
    # Replicate along dp promises that the two ranks of a dp group hold the same term: so the term depends on the
    # tp coordinate only (1 and 2; the whole is 3 on every rank). from_local does not check that promise by default.
    term = torch.full((2,), float(mesh.get_local_rank("tp") + 1), device=device)
    partial = DTensor.from_local(term, mesh, [Replicate(), Partial()])
    pieces[repr((Replicate(), Partial()))] = {"local": partial.to_local(), "full": partial.full_tensor()}

    result(coordinate=mesh.get_coordinate(), groups=groups, mesh=mesh.mesh.tolist(), pieces=pieces,
           agent=int(os.environ.get("GROUP_RANK", 0)))  # torchrun: which agent (node) started this rank
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
