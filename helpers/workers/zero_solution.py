"""Solutions to lesson 09's four steps: BucketedDDP, Zero1, Zero2, Zero3 (ours, not torch's classes).

    torchrun --standalone --nproc-per-node 2 helpers/workers/zero_check.py --impl solution --stage zero3

Not a script: helpers/workers/zero_check.py loads these classes (or the learner's, from my_*.py) and checks
them against torch's DistributedDataParallel and fully_shard. Every Zero class shards each parameter the
same way: flattened, padded with zeros to a multiple of the world size, rank r keeps chunk r
(helpers.kit.zero.padded_flat). `shards` maps each parameter to this rank's shard; `optimizer` is the
ordinary optimizer that updates the shards.
"""
import torch
import torch.distributed as dist
from torch import nn

from helpers.kit.zero import alloc_storage, free_storage, padded_flat


class BucketedDDP(nn.Module):
    """Gradients are all-reduced a bucket at a time, as soon as a bucket's last gradient is ready."""

    def __init__(self, module: nn.Module, bucket_cap_mb: float = 25.0) -> None:
        super().__init__()
        self.module, self.world_size = module, dist.get_world_size()
        cap, size, self.buckets = int(bucket_cap_mb * 2**20), 0, [[]]
        for p in reversed([p for p in module.parameters() if p.requires_grad]):  # gradients arrive back to front
            if size >= cap:  # close a bucket once it holds at least `cap` bytes (never split a tensor)
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
            p.register_post_accumulate_grad_hook(self._gradient_ready)
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready, self.in_flight = [0] * len(self.buckets), []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] == len(self.buckets[i]):  # the bucket is full: send it now, keep computing
            flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])
            self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))

    def finish_gradient_synchronization(self) -> None:
        for i, flat, work in self.in_flight:
            work.wait()
            averages = (flat / self.world_size).split([q.numel() for q in self.buckets[i]])
            for q, average in zip(self.buckets[i], averages, strict=True):
                q.grad.copy_(average.view_as(q))
        self.ready, self.in_flight = [0] * len(self.buckets), []


class Zero1:
    """ZeRO-1: each rank keeps optimizer state for its shard of every parameter only."""

    def __init__(self, params, optimizer_class, **kwargs) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in params if p.requires_grad]
        self.shards = {p: nn.Parameter(padded_flat(p, self.world_size).chunk(self.world_size)[self.rank].clone())
                       for p in self.params}
        self.optimizer = optimizer_class(list(self.shards.values()), **kwargs)

    def _reduce_scatter(self, p: nn.Parameter) -> None:
        """This rank's shard of the gradient summed over ranks, divided by the world size."""
        shard = self.shards[p]
        summed = torch.empty_like(shard)
        dist.reduce_scatter_single(summed, padded_flat(p.grad, self.world_size))
        shard.grad = summed / self.world_size if shard.grad is None else shard.grad + summed / self.world_size

    def _all_gather(self, p: nn.Parameter) -> None:
        full = torch.empty(self.world_size * self.shards[p].numel(), dtype=p.dtype, device=p.device)
        dist.all_gather_single(full, self.shards[p].detach())
        alloc_storage(p)
        p.data.copy_(full[: p.numel()].view_as(p))  # .data: autograd must not see this copy

    def step(self) -> None:
        for p in self.params:
            self._reduce_scatter(p)
        self.optimizer.step()
        for p in self.params:
            self._all_gather(p)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()


class Zero2(Zero1):
    """ZeRO-2: each gradient is reduce-scattered as soon as it is ready, and only the shard is kept."""

    def __init__(self, params, optimizer_class, **kwargs) -> None:
        super().__init__(params, optimizer_class, **kwargs)
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        self._reduce_scatter(p)
        p.grad = None  # the full gradient is freed during backward

    def step(self) -> None:
        self.optimizer.step()
        for p in self.params:
            self._all_gather(p)


class Zero3(Zero2):
    """ZeRO-3: parameters are sharded too; a unit is gathered just before it runs, forward and backward."""

    def __init__(self, model: nn.Module, units: list[nn.Module], optimizer_class, **kwargs) -> None:
        super().__init__(model.parameters(), optimizer_class, **kwargs)
        self.units, self.gathering = list(units), {}
        for p in self.params:
            free_storage(p)
        for i, unit in enumerate(self.units):
            unit.register_forward_pre_hook(lambda module, args, i=i: self._gather(i, prefetch=i + 1))
            unit.register_forward_hook(lambda module, args, output, i=i: self._free(i))
            unit.register_full_backward_pre_hook(lambda module, grad, i=i: self._gather(i, prefetch=i - 1))

    def _start_gather(self, i: int) -> None:
        if 0 <= i < len(self.units) and i not in self.gathering:
            self.gathering[i] = []
            for p in self.units[i].parameters():
                full = torch.empty(self.world_size * self.shards[p].numel(), dtype=p.dtype, device=p.device)
                work = dist.all_gather_single(full, self.shards[p].detach(), async_op=True)
                self.gathering[i].append((p, full, work))

    def _gather(self, i: int, prefetch: int) -> None:
        self._start_gather(i)
        self._start_gather(prefetch)  # the next unit's all-gather runs while this unit computes
        for p, full, work in self.gathering.pop(i):
            work.wait()
            alloc_storage(p)
            p.data.copy_(full[: p.numel()].view_as(p))

    def _free(self, i: int) -> None:
        for p in self.units[i].parameters():
            free_storage(p)

    def _gradient_ready(self, p: nn.Parameter) -> None:
        super()._gradient_ready(p)
        free_storage(p)  # its gradient is out: the full parameter is not needed until the next forward

    def step(self) -> None:
        self.optimizer.step()  # no all-gather: the next forward gathers each unit when it needs it
