"""Which tensors that cross the wire does distributed autograd link? Leaf tensors yes, nn.Parameters no.

    torchrun --standalone --nproc-per-node 2 helpers/workers/rpc_parameter_trap.py

Rank 0 ("ps") owns a Linear layer and a plain leaf tensor; rank 1 ("trainer1") pulls tensors from it
inside a distributed autograd context, computes a loss, calls dist_autograd.backward, and asks the
owner which of its tensors received a gradient in that context. Four cases:
  the trainer's own leaf tensor, sent as an argument (PyTorch's dist_autograd example does this);
  the owner's plain leaf tensor, returned;
  the owner's nn.Parameters, returned: no gradient reaches the owner, because the RPC pickler
    (torch/distributed/rpc/internal.py) handles exactly torch.Tensor, and nn.Parameter pickles
    itself through Parameter.__reduce_ex__ (torch/nn/parameter.py), which sends self.data: detached;
  views of those parameters (p.view_as(p)): plain tensors with a grad_fn, so they are linked.
"""
import torch
import torch.distributed.autograd as dist_autograd
import torch.distributed.rpc as rpc
from torch import nn

from helpers.kit.reporting import result
from helpers.kit.rpc import start_rpc, worker_name

torch.manual_seed(0)
layer = nn.Linear(3, 1)  # lives on every rank, but only the owner's ("ps") is used
leaf = torch.ones(3, requires_grad=True)  # a plain torch.Tensor that requires grad: a leaf
OWNED = {"weight": layer.weight, "bias": layer.bias, "leaf": leaf}


def pull(case: str) -> list[torch.Tensor]:
    """Runs on the owner: what the trainer receives."""
    if case == "owner's leaf tensor, returned":
        return [leaf]
    if case == "owner's nn.Parameters, returned":
        return list(layer.parameters())
    return [p.view_as(p) for p in layer.parameters()]


def gradients_on_owner(context_id: int) -> list[str]:
    """Runs on the owner: which of its tensors have a gradient in this distributed autograd context."""
    grads = dist_autograd.get_gradients(context_id)
    return [name for name, tensor in OWNED.items() if tensor in grads]


def probe(owner: str, case: str) -> dict:
    with dist_autograd.context() as context_id:
        if case == "trainer's leaf tensor, sent":
            mine = torch.full((3,), 2.0, requires_grad=True)
            total = rpc.rpc_sync(owner, torch.add, args=(mine, 1.0)).sum()
            received = [mine]
        else:
            received = rpc.rpc_sync(owner, pull, args=(case,))
            total = sum(tensor.sum() for tensor in received)
        # What distributed autograd recorded on this side: one RecvRpcBackward per reply message that carried
        # tensors requiring grad (torch/csrc/distributed/autograd/utils.cpp, addRecvRpcBackward), however many.
        recv_functions = dist_autograd._retrieve_context(context_id)._recv_functions()
        dist_autograd.backward(context_id, [total])
        local = dist_autograd.get_gradients(context_id)
        return {"received_types": sorted({type(t).__name__ for t in received}),
                "tensors_received": len(received), "recv_functions": len(recv_functions),
                "gradients_on_owner": rpc.rpc_sync(owner, gradients_on_owner, args=(context_id,)),
                "gradients_on_trainer": sum(t in local for t in received)}


def main() -> None:
    rank, world_size = start_rpc()
    if rank != 0 or world_size == 1:
        cases = ["trainer's leaf tensor, sent", "owner's leaf tensor, returned",
                 "owner's nn.Parameters, returned", "views of the nn.Parameters, returned"]
        outcomes = {case: probe(worker_name(0), case) for case in cases}
        for case, outcome in outcomes.items():
            print(f"{case}: {outcome}")
        result(cases=outcomes)
    rpc.shutdown()


if __name__ == "__main__":
    main()
