"""Lesson 13's exercise harness: run a learner's compression hook inside torch's DDP, on every rank, and record it.

    torchrun --standalone --nproc-per-node 3 helpers/workers/faster_hook_check.py --impl solution

--impl: a file that defines compress_hook(process_group, bucket) (notebooks/my_compress_hook.py), or `solution`
(faster_hook_solution.py, in the teacher's copy only); repeat it to check several files in one launch (the tests do;
a file that crashes on every rank is then recorded, not raised; one that crashes on some ranks only leaves the
others waiting in a collective, and the launch times out).
For each file, a DDP copy of lesson 09's mlp (helpers.kit.zero.build_model,
buckets of 0.01 MiB: one bucket in step 0, two after DDP's rebuild) takes 3 steps on each rank's own data, twice:
1. on DDP's default group (every rank; the check registers state=None, so the hook gets None);
2. (2 ranks or more) on a process group that is not WORLD: the ranks split in two groups, all but the last rank, and
   the last rank alone; DDP is given that group and the check registers it as the state, so the hook receives it.
The hook is registered through a wrapper of ours that records what DDP handed the hook (each bucket's values), what
the hook returned (a Future? completed within --deadline seconds? holding one tensor of the bucket's shape and
dtype?), whether the all-reduce came from torch's own hooks (torch/distributed/algorithms/ddp_comm_hooks/), and
hands DDP a completed future so that the step goes on whatever the hook did. Every call the hook and its callbacks
made to torch.distributed is logged (helpers.kit.zero.CommLog). After each backward the gradient DDP left in .grad is
compared with the exact average over the hook's group, the average over every rank, and this rank's own gradient.
helpers/lessons/faster_step.py decides. Works with one process (then step 2 is left out).
"""
import argparse
import importlib.util
import re
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import average, fit_residual, flat_grad, local_gradient, relative_error, release
from helpers.kit.reporting import result
from helpers.kit.zero import CommLog, build_model, is_call

STEPS, CAP_MB = 3, 0.01
TORCH_HOOKS = "ddp_comm_hooks"  # torch/distributed/algorithms/ddp_comm_hooks/: default_hooks.py, powerSGD_hook.py


class TorchHookSpy:
    """Wraps dist.all_reduce and notes each call made from torch's own comm hooks (the caller's file), so that a
    compress_hook that hands the bucket to fp16_compress_hook is told so."""

    def __init__(self) -> None:
        self.callers: list[str] = []

    def install(self) -> "TorchHookSpy":
        original = dist.all_reduce

        def all_reduce(*args, **kwargs):
            caller = sys._getframe(1).f_code
            if TORCH_HOOKS in caller.co_filename:
                self.callers.append(f"{Path(caller.co_filename).name} ({caller.co_name})")
            return original(*args, **kwargs)
        dist.all_reduce = all_reduce
        return self

    def take(self) -> list[str]:
        callers, self.callers = self.callers, []
        return callers


# before the learner's file is loaded, so that `from torch.distributed import all_reduce` there is seen too
log = CommLog().install()
spy = TorchHookSpy().install()


def load_hook(impl: str):
    path = Path(__file__).with_name("faster_hook_solution.py") if impl == "solution" else Path(impl)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, "compress_hook", None)


def completed(value: torch.Tensor) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future


def callback_error(text: str) -> dict:
    """torch's text for an error raised in a future's callback: "Got the following error when running the callback:
    NameError: ...", then "At:" and the frames, innermost first ("  /path/file.py(22): decompress")."""
    message = text.strip().splitlines()[0].split("callback: ", 1)[-1]
    frame = re.search(r"^\s*(\S+)\((\d+)\): (\S+)", text.split("At:", 1)[-1], re.MULTILINE)
    where = f"{Path(frame[1]).name}:{frame[2]} (in {frame[3]})" if frame else None
    return {"error": message[:300], "where": where}


def inspecting(hook, problems: list, buckets: list, deadline: float):
    """A hook that runs `hook` and records, on this rank, the first thing wrong with what it returned."""
    def inspect_hook(state, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        buckets.append({"values": buffer.numel(), "dtype": str(buffer.dtype)})
        original = buffer.clone()
        spy.take()
        future = hook(state, bucket)
        torchs = spy.take()
        if torchs:
            problems.append({"kind": "torch's hook", "function": torchs[0]})
        if not isinstance(future, torch._C.Future):  # torch.futures.Future and what get_future() returns
            problems.append({"kind": "not a future", "type": type(future).__name__})
            return completed(original)
        waited = time.monotonic() + (0 if problems and problems[0]["kind"] == "unfinished" else deadline)
        while not future.done() and time.monotonic() < waited:
            time.sleep(0.001)
        if not future.done():
            problems.append({"kind": "unfinished", "deadline": deadline})
            return completed(original)
        try:
            value = future.value()
        except Exception as error:  # the hook's callback raised; the future holds its error and where it happened
            problems.append({"kind": "failed future", **callback_error(str(error))})
            return completed(original)
        if not isinstance(value, torch.Tensor):
            problems.append({"kind": "not a tensor", "type": type(value).__name__})
            value = value[0] if isinstance(value, (list, tuple)) and value else original
        elif value.shape != buffer.shape:
            problems.append({"kind": "shape", "shape": list(value.shape), "bucket_shape": list(buffer.shape)})
            return completed(original)
        elif value.dtype != buffer.dtype:
            problems.append({"kind": "dtype", "dtype": str(value.dtype), "bucket_dtype": str(buffer.dtype)})
        return completed(value.to(buffer.dtype).reshape(buffer.shape))
    return inspect_hook


def groups(rank: int, world_size: int) -> list[tuple[str, dist.ProcessGroup | None]]:
    """(what the learner is told, the group DDP gets): the default group, then (2 ranks or more) a group that is not
    WORLD. Every rank takes part in making each group, member or not."""
    found = [(f"DDP's default group ({world_size} rank{'s' if world_size > 1 else ''}, process_group=None)", None)]
    if world_size > 1:
        first, last = dist.new_group(list(range(world_size - 1))), dist.new_group([world_size - 1])
        mine = first if rank < world_size - 1 else last
        size = mine.size()
        found.append((f"a process group of {size} rank{'s' if size > 1 else ''} that is not WORLD", mine))
    return found


def check_one(impl: str, rank: int, world_size: int, device: torch.device, deadline: float,
              settings: list[tuple[str, dist.ProcessGroup | None]]) -> dict:
    hook = load_hook(impl)
    if hook is None:
        return {"missing": True}
    problems, steps = [], []
    for where, group in settings:
        model, _, width = build_model("mlp")
        reference, _, _ = build_model("mlp")
        model, reference = model.to(device), reference.to(device)
        ddp = DDP(model, bucket_cap_mb=CAP_MB, process_group=group)
        buckets: list[dict] = []
        ddp.register_comm_hook(group, inspecting(hook, problems, buckets, deadline))  # the hook's process_group
        log.take()  # DDP's constructor broadcast
        size = dist.get_world_size(group)
        for step in range(STEPS):
            generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
            batch = (torch.randn(8, width, generator=generator).to(device),
                     torch.randint(0, 10, (8,), generator=generator).to(device))
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
            ddp.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(ddp(batch[0]), batch[1]).backward()
            calls = [{"op": e["op"], "bytes": e["bytes"]} for e in log.take() if is_call(e)]  # not the waits
            own = local_gradient(reference, weights, batch)
            exact, everyone = average(own, group), average(own)
            log.take()  # the reference's own all-reduces
            got = flat_grad(model)
            steps.append({"step": step, "where": where, "group_size": size, "buckets": buckets[:], "calls": calls,
                          "error": relative_error(got, exact),
                          "ratio": (torch.dot(got, exact) / torch.dot(exact, exact)).item(),
                          "every_rank_fit": fit_residual(got, everyone),
                          "every_rank_differs": relative_error(everyone, exact), "own_fit": fit_residual(got, own)})
            buckets.clear()
            with torch.no_grad():  # a plain SGD step, the same on every rank of a group
                for p in model.parameters():
                    p -= 0.1 * p.grad
    return {"missing": False, "problems": problems, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", action="append", required=True)
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds a hook's future may take")
    args = parser.parse_args()
    rank, world_size, device = init_distributed()
    settings = groups(rank, world_size)
    checked = {}
    for impl in args.impl:
        if len(args.impl) == 1:  # a learner's check: a crash fails the launch and names the learner's line
            checked[impl] = check_one(impl, rank, world_size, device, args.deadline, settings)
            continue
        try:
            checked[impl] = check_one(impl, rank, world_size, device, args.deadline, settings)
        except Exception as error:  # several files in one launch (the tests): record it, go on to the next
            checked[impl] = {"crashed": f"{type(error).__name__}: {error}"}
            dist.barrier()
    result(checked=checked, world_size=world_size)
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
