"""DDP training that survives a crash: checkpoint every N steps, resume from it after a restart.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 helpers/workers/ft_train.py \
        --checkpoint ckpt.pt --fail-rank 1 --fail-step 7

--checkpoint PATH      save there every --checkpoint-every steps, and resume from it at start-up
--fail-rank/--fail-step  make one rank fail once, in the first attempt, at that step:
--fail-mode crash      the process is killed (SIGKILL), as when a machine or GPU dies
--fail-mode hang       the process stops answering; the others time out after --timeout seconds
--fail-mode mid-save   rank 0 is killed halfway through writing a checkpoint
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


def fail(mode: str, state: dict, checkpoint: str | None) -> None:
    """Simulate a failure; only in the first attempt, so that the restarted group can finish."""
    if mode == "hang":
        print(f"rank {dist.get_rank()}: stops answering (a stuck GPU, a frozen machine)")
        time.sleep(3600)
    if mode == "mid-save":
        data = _serialized(state)
        with open(temporary_path(checkpoint), "wb") as file:
            file.write(data[: len(data) // 2])  # half a checkpoint, then the power goes out
            file.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _serialized(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    # The timeout bounds every collective: a silent peer becomes an error, not an endless hang.
    dist.init_process_group(backend="nccl" if use_cuda else "gloo", timeout=timedelta(seconds=args.timeout))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))

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
            if attempt == 0 and rank == args.fail_rank and step == args.fail_step:
                snapshot = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                            "rng": rng_state(), "step": step}
                fail(args.fail_mode, snapshot, args.checkpoint)
            loss = torch.nn.functional.cross_entropy(model(images.to(device)), labels.to(device))
            optimizer.zero_grad()
            loss.backward()  # DDP all-reduces the gradients here: every rank must take part
            optimizer.step()
            step += 1
            report(step=step, loss=loss.item())
            progress(step, total=args.steps)
            if args.checkpoint and rank == 0 and step % args.checkpoint_every == 0:
                # One writer is enough: after the all-reduce every rank holds the same weights.
                save_checkpoint(args.checkpoint, {"model": model.module.state_dict(),
                                                  "optimizer": optimizer.state_dict(),
                                                  "rng": rng_state(), "step": step})
                print(f"step {step}: checkpoint saved")
            if step == args.steps:
                break

    parameters = torch.cat([p.detach().flatten() for p in model.module.parameters()]).cpu()
    result(parameters=parameters, steps=step, attempt=attempt)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
