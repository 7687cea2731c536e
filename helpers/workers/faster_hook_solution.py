"""Exercise solution (lesson 13): a DDP communication hook that all-reduces each bucket in 16 bits.

    torchrun --standalone --nproc-per-node 3 helpers/workers/faster_hook_check.py --impl solution

Cast the bucket to bfloat16 (2 bytes per value instead of 4, the same exponent range as float32, so a sum cannot
overflow), all-reduce it asynchronously, and return the all-reduce's future chained with a callback that casts
the sum back to the bucket's dtype and divides it by the number of ranks. torch's bf16_compress_hook
(torch/distributed/algorithms/ddp_comm_hooks/default_hooks.py) does the same, dividing before the all-reduce.
"""
import torch
import torch.distributed as dist


def compress_hook(process_group: dist.ProcessGroup, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16)
    future = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(done: torch.futures.Future) -> torch.Tensor:
        summed = done.value()[0]
        return summed.to(buffer.dtype).div_(group.size())

    return future.then(decompress)
