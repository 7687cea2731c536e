"""Lesson 13's exercise harness: run a learner's compression hook inside torch's DDP, on every rank, and record it.

    torchrun --standalone --nproc-per-node 2 helpers/workers/faster_hook_check.py --impl solution

--impl: a file that defines compress_hook(process_group, bucket) (notebooks/my_compress_hook.py), or `solution`
(faster_hook_solution.py); repeat it to check several files in one launch (the tests do; a file that crashes is
then recorded, not raised). For each file, a DDP copy of lesson 09's mlp (helpers.kit.zero.build_model, buckets
of 0.01 MiB: one bucket in step 0, two after DDP's rebuild) takes 3 steps on each rank's own data with the hook
registered through a wrapper of ours. The wrapper records what DDP handed the hook (each bucket's values), what
the hook returned (a Future? completed within --deadline seconds? holding one tensor of the bucket's shape and
dtype?), and hands DDP a completed future so that the step goes on whatever the hook did. Every call the hook
and its callbacks made to torch.distributed is logged (helpers.kit.zero.CommLog), and after each backward the
gradient DDP left in .grad is compared with the exact average of the ranks' gradients at the same weights.
helpers/lessons/faster_step.py decides. Works with one process.
"""
import argparse
import importlib.util
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.kit.distributed import init_distributed
from helpers.kit.faster_step import exact_average, flat_grad, relative_error, release
from helpers.kit.reporting import result
from helpers.kit.zero import CommLog, build_model, is_call

STEPS, CAP_MB = 3, 0.01
log = CommLog().install()  # before the learner's file is loaded, so `from torch.distributed import ...` is seen


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
        future = hook(state, bucket)
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


def check_one(impl: str, rank: int, world_size: int, deadline: float) -> dict:
    hook = load_hook(impl)
    if hook is None:
        return {"missing": True}
    model, _, width = build_model("mlp")
    reference, _, _ = build_model("mlp")
    ddp = DDP(model, bucket_cap_mb=CAP_MB)
    problems, buckets, steps = [], [], []
    ddp.register_comm_hook(None, inspecting(hook, problems, buckets, deadline))
    log.take()  # DDP's constructor broadcast
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(1000 * step + rank)  # each rank its own data
        batch = (torch.randn(8, width, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        ddp.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(ddp(batch[0]), batch[1]).backward()
        calls = [{"op": e["op"], "bytes": e["bytes"]} for e in log.take() if is_call(e)]  # not the waits
        exact = exact_average(reference, weights, batch, world_size)
        log.take()  # the reference's own all-reduce
        got = flat_grad(model)
        steps.append({"buckets": buckets[:], "calls": calls, "error": relative_error(got, exact),
                      "ratio": (torch.dot(got, exact) / torch.dot(exact, exact)).item()})
        buckets.clear()
        with torch.no_grad():  # a plain SGD step, the same on every rank
            for p in model.parameters():
                p -= 0.1 * p.grad
    return {"missing": False, "problems": problems, "steps": steps}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", action="append", required=True)
    parser.add_argument("--deadline", type=float, default=10.0, help="seconds a hook's future may take")
    args = parser.parse_args()
    rank, world_size, _ = init_distributed()
    checked = {}
    for impl in args.impl:
        if len(args.impl) == 1:  # a learner's check: a crash fails the launch and names the learner's line
            checked[impl] = check_one(impl, rank, world_size, args.deadline)
            continue
        try:
            checked[impl] = check_one(impl, rank, world_size, args.deadline)
        except Exception as error:  # several files in one launch (the tests): record it, go on to the next
            checked[impl] = {"crashed": f"{type(error).__name__}: {error}"}
            dist.barrier()
    result(checked=checked, world_size=world_size)
    release()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
