"""DDP training that survives a crash: checkpoint every N steps, resume from it after a restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 helpers/workers/fault_tolerance_train.py \
        --checkpoint ckpt.pt --fail-rank 1 --fail-step 7

--checkpoint PATH      save there every --checkpoint-every steps, and resume from it at start-up
--fail-rank/--fail-step  make one rank fail once, in the first attempt, at that step:
--fail-mode crash      the process raises an error, as when its GPU fails
--fail-mode hang       the process stops answering; the others time out after --timeout seconds
--fail-mode mid-save   rank 0 is killed (SIGKILL) halfway through writing the checkpoint of that step
Without --checkpoint a restart starts again from step 0. Works with one process, gloo or nccl.
"""
import argparse
import io
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from helpers.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state, temporary_path
from helpers.data import load
from helpers.models import SimpleModel
from helpers.worker import progress, report, result


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--per-rank-batch", type=int, default=32)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--fail-rank", type=int, default=None)
    parser.add_argument("--fail-step", type=int, default=None)
    parser.add_argument("--fail-mode", choices=["crash", "hang", "mid-save"], default="crash")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds a collective may wait")
    return parser.parse_args()


def failing_now(args: argparse.Namespace, rank: int, step: int) -> bool:
    """Fail once, in the first attempt only, so that the restarted group can finish."""
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return first_attempt and rank == args.fail_rank and step == args.fail_step


def fail(mode: str) -> None:
    if mode == "crash":
        raise RuntimeError(f"rank {dist.get_rank()}: simulated hardware failure")
    print(f"rank {dist.get_rank()}: stops answering (a stuck GPU, a frozen machine)")
    time.sleep(3600)


def die_while_saving(state: dict, checkpoint: str) -> None:
    """Write half of the checkpoint where save_checkpoint writes first, then get killed."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    with open(temporary_path(checkpoint), "wb") as file:
        file.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
    os.kill(os.getpid(), signal.SIGKILL)


def init_distributed(backend: str, timeout: timedelta) -> None:
    """init_process_group on a store prefixed by the attempt number.

    After a restart torchrun hands the new workers the same store as the first attempt; with plain
    env:// a new rank 0 can read the dead attempt's addresses and fail to connect. A prefix per
    attempt keeps the rounds apart.
    """
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent_hosts_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size,
                          is_master=rank == 0 and not agent_hosts_store, timeout=timeout)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=rank, world_size=world_size, timeout=timeout)


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    # The timeout bounds every collective: a silent peer becomes an error, not an endless hang.
    init_distributed("nccl" if use_cuda else "gloo", timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)  # same initial weights on every rank
    model = DDP(SimpleModel().to(device), device_ids=[local_rank] if use_cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_set, _ = load(train=True, limit=512)
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train_set, batch_size=args.per_rank_batch, sampler=sampler, drop_last=True)

    step = 0
    state = load_checkpoint(args.checkpoint, map_location=device) if args.checkpoint else None
    if state is not None:
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])  # momentum buffers too, or the run drifts
        set_rng_state(state["rng"])
        step = state["step"]
    if rank == 0:
        print(f"attempt {attempt}: world size {world_size}, starting at step {step}")

    while step < args.steps:
        epoch, skip = divmod(step, len(loader))
        sampler.set_epoch(epoch)  # the shuffle depends on the epoch only, so a resume sees the same batches
        for batch_index, (images, labels) in enumerate(loader):
            if batch_index < skip:
                continue
            if failing_now(args, rank, step) and args.fail_mode != "mid-save":
                fail(args.fail_mode)
            loss = torch.nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here: every rank must take part
            optimizer.step()
            step += 1
            report(step=step, loss=loss.item())
            progress(step, total=args.steps)
            if args.checkpoint and rank == 0 and step % args.checkpoint_every == 0:
                # One writer is enough: after the all-reduce every rank holds the same weights.
                state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                         "rng": rng_state(), "step": step}
                if failing_now(args, rank, step) and args.fail_mode == "mid-save":
                    die_while_saving(state, args.checkpoint)
                save_checkpoint(args.checkpoint, state)
                print(f"step {step}: checkpoint saved")
            if step == args.steps:
                break

    parameters = torch.cat([p.detach().flatten() for p in model.module.parameters()]).cpu()
    result(parameters=parameters, steps=step, attempt=attempt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
