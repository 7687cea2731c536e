"""DDP copies rank 0's weights to every rank when it wraps the model: seed each rank differently and look.

    torchrun --standalone --nproc-per-node 2 helpers/workers/ddp_broadcast.py

Each rank builds its model from its own seed (rank), so the ranks start with different weights.
Wrapping in DistributedDataParallel (init_sync=True, the default) broadcasts rank 0's parameters
and buffers (torch/nn/parallel/distributed.py calls _sync_module_states in torch/distributed/utils.py,
which calls dist._broadcast_coalesced from src=0). With init_sync=False nothing is sent.
"""
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.models import build_model
from helpers.kit.reporting import result
from helpers.kit.tensors import parameter_checksum


def main() -> None:
    rank, world_size, device = init_distributed()
    checksums = {}
    for init_sync in (False, True):
        torch.manual_seed(rank)  # a different start on every rank, on purpose
        model = build_model("simple").to(device)
        before = parameter_checksum(model)
        DDP(model, init_sync=init_sync)  # wraps the same module: its parameters are overwritten in place
        checksums[f"init_sync={init_sync}"] = {"before": before, "after": parameter_checksum(model)}
    print(f"rank {rank}: {checksums}")
    result(checksums=checksums, world_size=world_size)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
