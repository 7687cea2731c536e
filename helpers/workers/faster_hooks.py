"""DDP's communication hooks side by side: bytes on the wire, gradient error, loss, and time per step.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_hooks.py --steps 30

Six DDP copies of the same model (helpers.kit.faster_step.build_model), each with one of torch's hooks:
allreduce_hook (what DDP does without a hook), fp16_compress_hook, bf16_compress_hook, and powerSGD_hook with
matrix_approximation_rank 1, 2 and 4 (error feedback and warm start on, PowerSGD from step 2: the least
PowerSGDState allows with them); and two controls, PowerSGD r=1 and r=4 with error feedback off (the same bytes;
they show what error feedback adds to the gradient error). All train side by side on the same batches of the
shipped digits (each rank its own slice). Every step each rank records the collectives the hook issued
(helpers.kit.zero.CommLog: torch's hooks call dist.all_reduce, also from PowerSGD's callbacks), its loss, and the
gradient error: how far the gradient DDP left in .grad is from the exact average of the ranks' gradients at the same
weights (one plain all-reduce outside any hook, not counted). Then the six hooks (not the controls) take turns, step
after step, under the timing protocol (helpers.kit.timing). On GPUs (nccl) the models and batches go to this rank's
GPU. Works with one process.
"""
import argparse

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import (
    build_model,
    digits_batches,
    exact_average,
    flat_grad,
    relative_error,
    release,
    synchronize,
)
from helpers.kit.reporting import progress, result
from helpers.kit.timing import take_turns
from helpers.kit.zero import CommLog, is_call

POWERSGD_RANKS = (1, 2, 4)
NO_FEEDBACK_RANKS = (1, 4)  # the controls
NO_FEEDBACK = ", no feedback"


def hooks() -> dict:
    """Setting name -> (hook state, hook). PowerSGDState needs the process group, so build it after joining one."""
    settings = {"all-reduce": (None, default_hooks.allreduce_hook), "fp16": (None, default_hooks.fp16_compress_hook),
                "bf16": (None, default_hooks.bf16_compress_hook)}
    for r in POWERSGD_RANKS:  # r: the rank of the low-rank approximation, not a process's rank
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        settings[f"PowerSGD r={r}"] = (state, powerSGD_hook.powerSGD_hook)
    for r in NO_FEEDBACK_RANKS:
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2,
                                            use_error_feedback=False)
        settings[f"PowerSGD r={r}{NO_FEEDBACK}"] = (state, powerSGD_hook.powerSGD_hook)
    return settings


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    batches = digits_batches(rank, args.per_rank_batch, args.steps, device)
    models = {}
    for name, (state, hook) in hooks().items():
        model = DDP(build_model().to(device))
        model.register_comm_hook(state, hook)
        models[name] = (model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), state)
    reference = build_model().to(device)
    log = CommLog().install()  # after the constructors: their broadcast is not part of a step
    record = {name: {"collectives": [], "error": [], "loss": []} for name in models}
    for step, batch in enumerate(batches):
        for name, (model, optimizer, _) in models.items():
            weights = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
            optimizer.zero_grad(set_to_none=True)
            loss = torch.nn.functional.cross_entropy(model(batch[0]), batch[1])
            loss.backward()
            record[name]["collectives"].append([e for e in log.take() if is_call(e)])  # not the waits
            exact = exact_average(reference, weights, batch)
            log.take()  # the reference's all-reduce is not the hook's
            record[name]["error"].append(relative_error(flat_grad(model), exact))
            record[name]["loss"].append(loss.item())
            optimizer.step()
        progress(step + 1, args.steps + 1)
    log.uninstall()

    def one_step(model, optimizer, batch=batches[0]):
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(batch[0]), batch[1]).backward()
        optimizer.step()
        synchronize(device)

    settings = {name: (lambda m=model, o=optimizer: one_step(m, o)) for name, (model, optimizer, _) in models.items()
                if NO_FEEDBACK not in name}
    timings = take_turns(settings, rounds=args.rounds, warmup=1, repeat=3, between=dist.barrier)
    progress(args.steps + 1, args.steps + 1)
    shapes = [list(p.shape) for p in reversed(list(models["all-reduce"][0].module.parameters()))]
    stats = {name: state.compression_stats() for name, (_, _, state) in models.items() if state is not None}
    result(record=record, timings={name: t.as_dict() for name, t in timings.items()}, shapes=shapes,
           powersgd_stats=stats, start_powersgd=2, world_size=world_size, threads=torch.get_num_threads())
    release(models, settings)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
