"""Lesson 12's answer to exercise 4: a mixture-of-experts layer whose experts live on different ranks.

    torchrun --standalone --nproc-per-node 2 helpers/workers/experts_check.py --impl solution

Every rank routes its own tokens (top-2), keeps what fits each expert's capacity, sends each kept (token, choice)
to the rank that owns the expert (all-to-all, uneven: the counts are exchanged first), runs its own experts on what
arrived, sends the results back (the reverse all-to-all) and adds them up, weighted by the router. After
torchtitan's AllToAllTokenDispatcher (torchtitan/models/common/token_dispatcher.py:228, commit b5bcd76): the counts by
an all-to-all (line 450), the tokens out (465) and back (601), weighted after the experts (616-619); here the tokens go
by all_to_all_single_autograd, whose backward is the reverse all-to-all.
"""
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from helpers.kit.context_experts import capacity, capacity_keep, route


class ExpertParallelMoE(nn.Module):
    def __init__(self, router, experts, num_experts, top_k=2, capacity_factor=None):
        """router: the same Linear on every rank; experts: this rank's experts, global numbers
        rank * len(experts) ... (rank + 1) * len(experts) - 1."""
        super().__init__()
        self.router, self.experts = router, experts
        self.num_experts, self.top_k, self.capacity_factor = num_experts, top_k, capacity_factor
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.kept = None  # which (token, choice) assignments the last forward kept: bool [tokens, top_k]

    def forward(self, x):
        chosen, weights, _ = route(x, self.router, self.top_k)
        if self.capacity_factor is None:
            self.kept = torch.ones_like(chosen, dtype=torch.bool)
        else:
            limit = capacity(len(x), self.num_experts, self.capacity_factor, self.top_k)
            self.kept = capacity_keep(chosen, self.num_experts, limit)
        token, slot = torch.nonzero(self.kept, as_tuple=True)
        expert = chosen[token, slot]
        order = torch.argsort(expert, stable=True)  # by expert, so by the rank that owns it
        token, slot, expert = token[order], slot[order], expert[order]

        # 1. counts first: how many rows each rank will receive from each rank, for each of its experts
        local = len(self.experts)
        sending = torch.bincount(expert, minlength=self.num_experts)
        receiving = torch.empty_like(sending)
        dist.all_to_all_single(receiving, sending)  # equal splits: `local` counts to every rank
        send_rows = sending.view(self.world_size, local).sum(dim=1).tolist()
        receive_rows = receiving.view(self.world_size, local).sum(dim=1).tolist()

        # 2. the tokens travel to their experts' ranks
        arrived = all_to_all_single_autograd(x[token], receive_rows, send_rows, dist.group.WORLD)
        # rows arrive by source rank, and within each source by local expert
        which = torch.arange(local).repeat(self.world_size).repeat_interleave(receiving)
        results = arrived.new_zeros(arrived.shape)
        for i, expert_module in enumerate(self.experts):
            rows = torch.nonzero(which == i).squeeze(1)
            results = results.index_copy(0, rows, expert_module(arrived[rows]))

        # 3. the results travel back, in the order they came, and add up by the router's weights
        back = all_to_all_single_autograd(results, send_rows, receive_rows, dist.group.WORLD)
        return torch.zeros_like(x).index_add(0, token, weights[token, slot].unsqueeze(-1) * back)
