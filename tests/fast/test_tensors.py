"""helpers.kit.tensors' byte counts: a tensor's own elements against the memory behind it (lessons 03, 07, 09, 11)."""
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from helpers.kit.tensors import local_shard, own_bytes, storage_bytes
from helpers.lessons.scale import simulated_world


def test_own_bytes_count_every_view_and_storage_bytes_each_storage_once():
    weight = torch.zeros(4, 4)
    view = weight[:2]
    assert own_bytes([weight, view, None]) == 64 + 32
    assert storage_bytes([weight, view, None]) == 64  # one storage under both: catches a count per tensor
    other = torch.zeros(4, 4)  # equal values, its own memory: catches storages told apart by value or shape
    assert storage_bytes([weight, other]) == 128
    weight.untyped_storage().resize_(0)  # freed, as ZeRO-3 frees a gathered weight
    assert storage_bytes([weight, view]) == 0 and own_bytes([weight]) == 64


def test_a_dtensor_counts_its_local_shard_and_the_padded_storage_behind_it():
    with simulated_world(4, rank=3):
        mesh = init_device_mesh("cpu", (4,))
        sharded = distribute_tensor(torch.zeros(10, 8), mesh, [Shard(0)])  # 10 rows on 4 ranks: 3, 3, 3 and 1
        assert local_shard(sharded).shape == (1, 8) and local_shard(torch.zeros(2)).shape == (2,)
        assert own_bytes([sharded]) == 1 * 8 * 4  # the last rank's one row, not the whole tensor's 10
        # torch scatters padded chunks of ceil(10 / 4) = 3 rows: the last rank's row sits in a 3-row storage
        assert storage_bytes([sharded]) == 3 * 8 * 4
