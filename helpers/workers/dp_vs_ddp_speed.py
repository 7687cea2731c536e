"""DataParallel (threads in one process) against DDP (processes), taking turns in one launch, with controls.

    torchrun --standalone --nproc-per-node 2 helpers/workers/dp_vs_ddp_speed.py --global-batch 256

Every setting trains its own copy of the same wide MLP (matrix multiplies dominate) from the same weights, on the
same sequence of global batches, for the same number of steps:
- "DDP, 2 processes": one intra-op thread per rank, DistributedDataParallel, global batch / world size per rank;
- "our DataParallel": rank 0 alone, our rebuild (helpers.kit.dp_vs_ddp.NaiveDataParallel) with 2 device threads
  and one intra-op thread, so as many threads compute as DDP has processes;
- "1 process, 2 threads": rank 0 alone, no wrapper, 2 intra-op threads: the same cores without any DP;
- "1 process, 1 thread": rank 0 alone, the control: what one core does.
The settings take turns (helpers/kit/timing.py: a shuffled order each round, the same on every rank, after a warm-up
round); each turn runs --turn-steps steps, wall time and CPU time side by side, after a barrier, so a rank that sits
a setting out waits there. Rank 0 hands back the timings and how far each setting's final weights are from the
control's (they train on the same gradients, so they must agree).
With two or more GPUs the settings are torch's nn.DataParallel over every GPU (rank 0) and DDP with one process
per GPU (launch it with --nproc-per-node set to the number of GPUs).
"""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.dp_vs_ddp import NaiveDataParallel
from helpers.kit.models import mlp
from helpers.kit.reporting import progress, result
from helpers.kit.tensors import flat, max_abs_diff
from helpers.kit.timing import take_turns


def batches(count: int, global_batch: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.rand(global_batch, 1, 28, 28, generator=generator).to(device),
             torch.randint(0, 10, (global_batch,), generator=generator).to(device)) for _ in range(count)]


class Trainer:
    """One setting: its own model (same start as every other), its optimizer, and the next batch to train on."""

    def __init__(self, width: int, depth: int, device: torch.device, data: list, threads: int, wrap=None,
                 rank_slice: slice = slice(None)) -> None:
        torch.manual_seed(0)
        self.model = mlp(width, depth - 2).to(device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.wrapped = wrap(self.model) if wrap else self.model
        self.data, self.threads, self.rank_slice, self.steps = data, threads, rank_slice, 0
        self.naive = None

    def step(self) -> None:
        if torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        images, labels = self.data[self.steps % len(self.data)]
        images, labels = images[self.rank_slice], labels[self.rank_slice]
        self.optimizer.zero_grad(set_to_none=True)
        if self.naive is not None:
            self.naive.train_step(images, labels, nn.functional.cross_entropy, self.optimizer)
        else:
            nn.functional.cross_entropy(self.wrapped(images), labels).backward()
            self.optimizer.step()
        if images.is_cuda:
            torch.cuda.synchronize()
        self.steps += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--global-batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--turn-steps", type=int, default=2, help="steps per turn")
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args()

    rank, world_size, device = init_distributed()
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    per_rank = args.global_batch // world_size
    data = batches(4, args.global_batch, device)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    trainers = {f"DDP, {world_size} processes": Trainer(args.width, args.depth, device, data, 1, DDP, mine)}
    if rank == 0 and gpus >= 2:
        trainers[f"torch's nn.DataParallel, {gpus} GPUs"] = Trainer(args.width, args.depth, device, data, 1,
                                                                    nn.DataParallel)
    elif rank == 0:
        ours = Trainer(args.width, args.depth, device, data, 1)
        ours.naive = NaiveDataParallel(ours.model, world_size, evidence=False)
        trainers[f"our DataParallel, {world_size} threads"] = ours
        trainers["1 process, 2 threads"] = Trainer(args.width, args.depth, device, data, 2)
        trainers["1 process, 1 thread"] = Trainer(args.width, args.depth, device, data, 1)
    names = [f"DDP, {world_size} processes"] + ([f"torch's nn.DataParallel, {gpus} GPUs"] if gpus >= 2 else
                                                 [f"our DataParallel, {world_size} threads", "1 process, 2 threads",
                                                  "1 process, 1 thread"])
    settings = {name: (trainers[name].step if name in trainers else (lambda: None)) for name in names}
    turns = [0]

    def barrier() -> None:  # every turn starts on every rank at once; a rank that sits it out waits here
        if turns[0] % len(settings) == 0:
            progress(turns[0] // len(settings), args.warmup + args.rounds)
        turns[0] += 1
        dist.barrier()

    timings = take_turns(settings, rounds=args.rounds, warmup=args.warmup, repeat=args.turn_steps, between=barrier)
    dist.barrier()
    progress(args.warmup + args.rounds, args.warmup + args.rounds)
    result(timings={name: timing.as_dict() for name, timing in timings.items()})
    if rank == 0:
        weights = {name: flat([p.detach().cpu() for p in trainer.model.parameters()])
                   for name, trainer in trainers.items()}
        reference = names[-1]  # the control on CPU; DataParallel on GPUs
        result(what=names, reference=reference, global_batch=args.global_batch, device=device.type,
               parameters=weights[reference].numel(), steps={name: t.steps for name, t in trainers.items()},
               weights_diff={name: max_abs_diff(w, weights[reference]) for name, w in weights.items()})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
