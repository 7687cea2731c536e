"""pick_backend("nccl") refuses a GPU the installed torch has no kernels for (lesson 06, 'The code must be in the
image'): torch.cuda.is_available() counts such a GPU, so the check must look at its compute capability.
The GPU is faked by monkeypatching torch.cuda, so this runs on the CPU."""
from __future__ import annotations

import pytest
import torch

from helpers.kit.distributed import _kernels_for, pick_backend

BUILD = ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"]  # torch 2.14.1's CUDA 13.0 wheel


def _fake_gpu(monkeypatch, capability):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: BUILD)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


@pytest.mark.parametrize("capability", [(7, 0), (6, 0)])  # V100, P100: counted by is_available(), no kernels
def test_nccl_refuses_a_gpu_older_than_the_build(monkeypatch, capability):
    _fake_gpu(monkeypatch, capability)
    with pytest.raises(RuntimeError, match=f"sm_{capability[0]}{capability[1]}.*no kernel image"):
        pick_backend("nccl")


@pytest.mark.parametrize("capability", [(7, 5), (8, 9), (9, 0), (12, 0)])  # T4, L4 (runs sm_86 cubins), H100, ...
def test_nccl_accepts_a_gpu_the_build_has_kernels_for(monkeypatch, capability):
    _fake_gpu(monkeypatch, capability)
    assert pick_backend("nccl") == ("nccl", torch.device("cuda:0"))


def test_compatibility_rule():
    assert _kernels_for(8, 9, ["sm_86"])  # a cubin runs on a later minor of its major
    assert not _kernels_for(8, 0, ["sm_86"])  # ... never on an earlier one
    assert not _kernels_for(9, 0, ["sm_86"])  # ... nor on another major
    assert _kernels_for(9, 0, ["compute_80"])  # PTX is compiled for any later GPU
    assert _kernels_for(10, 0, ["sm_100a"])  # arch-specific suffixes are read
