"""The one worker preamble: join the process group the way the hardware wants.

    from helpers.kit.distributed import init_distributed
    rank, world_size, device = init_distributed()

- Under `torchrun` (RANK in the environment) it joins the group torchrun describes: `nccl` with one
  CUDA device per rank (`torch.cuda.set_device(local_rank)` and `device_id=`, so that NCCL binds the
  right GPU at once), `gloo` on CPU.
- `init_distributed("nccl")` insists on GPUs: without CUDA it raises instead of falling back to gloo on the CPU.
- Under plain `python` it makes a group of one (a HashStore, no network), so every worker also runs
  as a single process.

Lessons 00 and 02 write this out by hand, because there it is the lesson; every other worker calls this.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

# Imported now, before any process group exists, on purpose. torch/distributed/nn/functional.py (torch 2.14)
# writes `group=group.WORLD` as the default argument of its collectives (broadcast, line 32, and nine more), and
# Python evaluates a default once, when the module is imported. DistributedDataParallel's constructor imports it
# (it touches torch._dynamo, which imports fsdp, then _shard, then this module), so a worker that builds DDP after
# init_process_group stores its default group in those defaults for good: destroy_process_group() then cannot free
# it, and gloo's worker threads live on into interpreter shutdown. We measured what that costs: about 1 run in 10
# of a 2-rank job whose last collective (a checkpoint's gather_object) came just before exit died with "terminate
# called without an active exception" (SIGABRT). The core dump's stacks: the main thread in Py_FinalizeEx, a gloo
# thread (ProcessGroupGloo::runLoop) destroying that collective's work, whose tensor had a Python object, waiting
# for the GIL; Python 3.11 ends such a thread (pthread_exit) inside the C++ destructor, which aborts the process.
# Imported first, the defaults are None (the default group, looked up at each call): the group then lives only as
# long as what uses it (a DDP model holds it as .process_group), and goes when the model does, before shutdown
# unless the model is kept in a module global. Workers that do not import this module (lesson 02's own) are
# covered when the launcher starts them (its bootstrap and launch server import the module first).
import torch.distributed.nn.functional


def pick_backend(backend: str | None = None) -> tuple[str, torch.device]:
    """`nccl` and this rank's GPU when CUDA is present, else `gloo` and the CPU; `backend` overrides.

    backend="nccl" without a usable GPU raises at once: a job that asked for GPUs must not train on the CPU.
    """
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            f"backend 'nccl' needs CUDA, but torch.cuda.is_available() is False. This torch "
            f"({torch.__version__}, CUDA {torch.version.cuda}) has kernels for the GPU architectures "
            f"{' '.join(torch.cuda.get_arch_list()) or 'none: a CPU-only build'} with a driver new enough for its "
            f"CUDA; check nvidia-smi, the driver version and that the container sees the GPUs.")
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        _check_gpu_architecture(local_rank)
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    return backend or ("nccl" if use_cuda else "gloo"), device


def _kernels_for(major: int, minor: int, arch_list: list[str]) -> bool:
    """Whether a build with kernels for `arch_list` (torch.cuda.get_arch_list()) runs on a GPU of compute
    capability major.minor: a cubin for sm_XY runs on X.z with z >= Y (same major), PTX (compute_XY) on any
    capability >= X.Y (JIT-compiled)."""
    for arch in arch_list:
        kind, _, number = arch.partition("_")
        version = int(number.rstrip("af"))
        if kind == "sm" and version // 10 == major and version % 10 <= minor:
            return True
        if kind == "compute" and version <= 10 * major + minor:
            return True
    return False


def _check_gpu_architecture(local_rank: int) -> None:
    """torch.cuda.is_available() only counts devices (torch._C._cuda_getDeviceCount() > 0): a GPU older than the
    build's kernels (a V100, sm_70, under a build for sm_75 and newer) is counted, torch only warns
    (_check_capability in torch/cuda/__init__.py), and the first kernel fails with "no kernel image is available".
    Refuse it here, by name."""
    arch_list = torch.cuda.get_arch_list()
    major, minor = torch.cuda.get_device_capability(local_rank)
    if arch_list and not _kernels_for(major, minor, arch_list):
        raise RuntimeError(
            f"backend 'nccl': GPU {local_rank} has compute capability sm_{major}{minor}, but this torch "
            f"({torch.__version__}, CUDA {torch.version.cuda}) has kernels only for {' '.join(arch_list)}: its "
            f"kernels would fail with 'no kernel image is available'. Use a torch build for this GPU or newer GPUs.")


def init_distributed(backend: str | None = None, **kwargs) -> tuple[int, int, torch.device]:
    """Join the process group; return (rank, world_size, device). Extra keywords go to init_process_group."""
    backend, device = pick_backend(backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs.setdefault("device_id", device)
    if "RANK" in os.environ:  # started by torchrun: the environment says who we are
        dist.init_process_group(backend, **kwargs)
    else:  # plain `python`: a group of one, no network needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return dist.get_rank(), dist.get_world_size(), device
