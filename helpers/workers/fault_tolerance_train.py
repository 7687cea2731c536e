"""DDP training that survives a crash: checkpoint every N steps, resume from it after a restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 helpers/workers/fault_tolerance_train.py \
        --checkpoint runs/fault_tolerance.pt --fail-rank 1 --fail-step 7

--steps N              train N steps in total (a resumed run counts the steps before the restart)
--per-rank-batch B     samples per rank and step; or --global-batch G: G / world_size per rank, so that a
                       job that resumes with fewer ranks still averages its gradient over G samples
--checkpoint PATH      save there every --checkpoint-every steps, and resume from it at start-up
--fail-rank/--fail-step  make a rank fail once, in the first attempt, at that step (no --fail-rank: every rank
                       that was given the flags):
--fail-mode crash      the process raises an error, as when its GPU fails
--fail-mode hang       the process stops answering; the others time out after --timeout seconds, and the
                       SIGTERM torchrun then sends it ends it (it gives up the polite-stop handler when it freezes)
--fail-mode mid-save   rank 0 is killed (SIGKILL) inside the save of that step's checkpoint, while torch.save
                       is pickling (the file it writes to is open and still empty)
--save-in-place        the control: save with torch.save(state, PATH) instead of save_checkpoint (no rename)
--fail-mode node-lost  this node's processes die: SIGKILL to this rank's torchrun agent (its parent), then to
                       itself. The kernel then closes their sockets, so the peers see the loss at once; after a
                       real power cut nothing is closed and the peers wait for --timeout instead
--fail-mode preempt    the polite kill of a scheduler (Slurm's --signal or preemption, a Kubernetes eviction):
                       this rank sends SIGTERM to its torchrun agent, which forwards it to every worker. Each
                       worker finishes its step; the ranks agree on the step to stop at, rank 0 saves a
                       checkpoint there, and all exit. A resubmitted job resumes with no step lost
--stop-seconds S       after SIGTERM, take S seconds before that save (a sleep of ours, standing in for the
                       write of a large checkpoint): torchrun SIGKILLs workers still running --shutdown-timeout
                       seconds after it forwarded the SIGTERM
--backend nccl         insist on GPUs: fail at start-up if CUDA is missing, instead of training on the CPU
Without --checkpoint a restart starts again from step 0. Works with one process, gloo or nccl.
"""
import argparse
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from helpers.kit.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from helpers.kit.data import load
from helpers.kit.distributed import init_distributed
from helpers.kit.models import SimpleModel
from helpers.kit.reporting import progress, report, result

NOISE = 0.05  # augmentation noise: every rank draws its own, so every rank's RNG state matters on resume


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    batch = parser.add_mutually_exclusive_group()
    batch.add_argument("--per-rank-batch", type=int, default=32)
    batch.add_argument("--global-batch", type=int, default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--save-in-place", action="store_true",
                        help="the control: torch.save straight to --checkpoint, instead of save_checkpoint")
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-step", type=int, default=None)
    parser.add_argument("--fail-mode", choices=["crash", "hang", "mid-save", "node-lost", "preempt"],
                        default="crash")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may wait")
    parser.add_argument("--stop-seconds", type=float, default=0.0,
                        help="after SIGTERM, sleep this long before the save (ours: a large checkpoint's write)")
    parser.add_argument("--backend", choices=["nccl", "gloo"], default=None,
                        help="default: nccl with CUDA, gloo without; nccl fails at once when CUDA is missing")
    return parser.parse_args()


def failing_now(args: argparse.Namespace, rank: int, step: int) -> bool:
    """Fail once, in the first attempt only, so that the restarted group can finish."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return first_attempt and args.fail_rank in (None, rank) and step == args.fail_step


_stop_requested = False


def _on_sigterm(signum, frame) -> None:
    """torchrun forwards SIGTERM to its workers and waits --shutdown-timeout seconds (30 by default) before a
    SIGKILL: the time to finish this step and save."""
    global _stop_requested
    _stop_requested = True


def stop_agreed(device: torch.device) -> bool:
    """Whether any rank was asked to stop: the ranks agree (one tiny all-reduce per step), so that they all stop
    after the same step; a rank that stopped alone would leave the others waiting in the next all-reduce."""
    flag = torch.tensor([float(_stop_requested)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def fail(mode: str, rank: int) -> None:
    if mode == "crash":
        raise RuntimeError(f"rank {rank}: simulated hardware failure")
    if mode == "preempt":
        print(f"rank {rank}: the scheduler asks the job to stop (SIGTERM to this node's torchrun agent)")
        os.kill(os.getppid(), signal.SIGTERM)  # the agent forwards it to every worker, this one included
        deadline = time.monotonic() + 30
        while not _stop_requested and time.monotonic() < deadline:  # so that the run stops at a known step
            time.sleep(0.01)
        return
    if mode == "node-lost":
        print(f"rank {rank}: this node is gone (its torchrun agent and this worker are killed)")
        os.kill(os.getppid(), signal.SIGKILL)  # the agent first: it must not restart this worker
        os.kill(os.getpid(), signal.SIGKILL)
    print(f"rank {rank}: stops answering (a stuck GPU, a frozen machine)")
    # A frozen rank never reaches the step where it would read _on_sigterm's flag: without that handler, torchrun's
    # SIGTERM ends it at once (kept, the signal would be caught for nothing, and torchrun would SIGKILL it 30 s later).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    time.sleep(3600)


class KilledWhileSaving:
    """Put into the state, it kills this process (SIGKILL) when torch.save pickles it: inside the real save.

    By then the file torch.save writes to is open (and so emptied), and torch.save is still pickling: it
    pickles the whole state into memory before it writes the first record (`_save` in
    torch/serialization.py:1246-1259). With save_checkpoint that file is the temporary one; written in place
    (--save-in-place), it is the checkpoint itself."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def join_group(timeout: timedelta, backend: str | None) -> tuple[int, int, torch.device, str, dist.Store]:
    """Join the group; return (rank, world_size, device, which store the group was built on, that store).

    Since torch 2.5 the c10d rendezvous hands the workers the agent's own TCPStore
    (TORCHELASTIC_USE_AGENT_STORE=True) and keeps it across restarts (next_rendezvous in
    torch/distributed/elastic/rendezvous/dynamic_rendezvous.py). A restarted group then finds the dead
    group's keys there, and plain init_process_group() can read a dead peer's address: upstream bug
    pytorch/pytorch#135712. Torch's own opt-out, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    (use_agent_store, dynamic_rendezvous.py:1146), gives every round a fresh store hosted by rank 0's
    worker: then a plain init is right, and that is what the generated Kubernetes jobs use.
    With the shared store this worker prefixes its keys with the attempt and the world size. That holds
    only while every agent counts the same restarts, as one agent does. Across agents it breaks: an agent
    that is replaced (a new pod, a restarted container) starts again at count 0, and an agent that restarts
    its workers because another node is waiting (a membership change) does not count it (_invoke_run in
    torch/distributed/elastic/agent/server/api.py).
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # plain python, or torch's opt-out
        rank, world_size, device = init_distributed(backend, timeout=timeout)
        return rank, world_size, device, "a fresh store for this round", dist.distributed_c10d._get_default_store()
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=False, timeout=timeout)  # the agent hosts it
    prefix = f"attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}_world_{world_size}"
    rank, world_size, device = init_distributed(backend, store=dist.PrefixStore(prefix, store), rank=rank,
                                                world_size=world_size, timeout=timeout)
    return rank, world_size, device, f"the agent's shared store, keys prefixed {prefix}", store


def main() -> None:
    args = parse_args()
    signal.signal(signal.SIGTERM, _on_sigterm)
    # The timeout bounds every collective: a silent peer becomes an error, not an endless hang.
    rank, world_size, device, store, group_store = join_group(timedelta(seconds=args.timeout), args.backend)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    earlier = None  # did a key that rank 0 of the previous attempt left in its store survive into this one?
    if rank == 0:
        earlier = group_store.check([f"left_by_attempt_{attempt - 1}"]) if attempt > 0 else None
        group_store.set(f"left_by_attempt_{attempt}", "1")
    if args.global_batch is not None and args.global_batch % world_size:
        raise ValueError(f"--global-batch {args.global_batch} does not split over {world_size} ranks")
    per_rank_batch = args.global_batch // world_size if args.global_batch else args.per_rank_batch

    torch.manual_seed(0)  # same initial weights on every rank
    model = DDP(SimpleModel().to(device), device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_set, _ = load(train=True, limit=512)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    # The loader gets a generator of its own: every iter() draws a seed from it (_BaseDataLoaderIter in
    # torch/utils/data/dataloader.py), and from the global one that draw would shift the noise on resume.
    loader = DataLoader(train_set, batch_size=per_rank_batch, sampler=sampler, drop_last=True,
                        generator=torch.Generator())
    torch.manual_seed(1000 + rank)  # from here on each rank draws its own augmentation noise

    step = 0
    state = load_checkpoint(args.checkpoint, map_location=device) if args.checkpoint else None
    if state is not None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # momentum buffers too, or the run drifts
        if rank < len(state["rng"]):
            set_rng_state(state["rng"][rank])  # this rank's own generator, not rank 0's
        step = state["step"]
    if rank == 0:
        print(f"attempt {attempt}: world size {world_size}, starting at step {step}")
        print(f"store of attempt {attempt}: {store}" + ("" if earlier is None else
              f"; the key attempt {attempt - 1} left there: {'still there' if earlier else 'gone'}"))

    while step < args.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)  # the shuffle depends on the epoch only, so a resume sees the same batches
        for batch_index, (images, labels) in enumerate(loader):
            if batch_index < skip:
                continue
            if failing_now(args, rank, step) and args.fail_mode != "mid-save":
                fail(args.fail_mode, rank)
            images = images + NOISE * torch.randn_like(images)
            loss = torch.nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here: every rank must take part
            optimizer.step()
            step += 1
            report(step=step, loss=loss.item(), world_size=world_size)
            progress(step, total=args.steps)
            stopping = stop_agreed(device)
            if stopping and args.stop_seconds:
                if rank == 0:
                    print(f"step {step}: SIGTERM: {args.stop_seconds:g} s of work before the save (a sleep of ours)",
                          flush=True)
                time.sleep(args.stop_seconds)
            if args.checkpoint and (step % args.checkpoint_every == 0 or stopping):
                save(args, model, optimizer, step, rank, world_size)
            if stopping:
                if rank == 0:
                    print(f"step {step}: stopping on SIGTERM, after saving this step")
                dist.destroy_process_group()
                return
            if step == args.steps:
                break

    parameters = torch.cat([p.detach().flatten() for p in model.module.parameters()]).cpu()
    result(parameters=parameters, steps=step, attempt=attempt, world_size=world_size, backend=dist.get_backend(),
           agent_store=os.environ.get("TORCHELASTIC_USE_AGENT_STORE"), earlier_attempts_key=earlier)
    dist.destroy_process_group()


def save(args: argparse.Namespace, model: DDP, optimizer: torch.optim.Optimizer, step: int, rank: int,
         world_size: int) -> None:
    """Rank 0 writes the weights and optimizer (after the all-reduce every rank holds the same ones), and
    every rank's own RNG state, gathered from all ranks."""
    states = [None] * world_size if rank == 0 else None
    dist.gather_object(rng_state(), states, dst=0)
    if rank != 0:
        return
    state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "rng": states,
             "step": step}
    if failing_now(args, rank, step) and args.fail_mode == "mid-save":
        state["killed_while_saving"] = KilledWhileSaving()  # last key: pickled after the tensors
    if args.save_in_place:  # the control: no temporary file, no rename
        torch.save(state, args.checkpoint)
    else:
        save_checkpoint(args.checkpoint, state)
    print(f"step {step}: checkpoint saved")


if __name__ == "__main__":
    main()
