"""Pins of the private torch and nbclient APIs that our production code patches or calls (the rest of lesson 11's are
in tests/test_scale.py). When an upgrade moves or changes one, the test that fails names the API and what of ours
relies on it, instead of a confusing "Not yet" from an exercise check or a notebook run that waits 300 s."""
from __future__ import annotations

import inspect
import sys
from unittest import mock

import pytest
import torch
from torch import nn

TORCH_CHANGED = "torch changed a private API that {} relies on (checked against torch 2.14.1): "
NBCLIENT_CHANGED = ("nbclient changed the private coroutines that helpers/tools/notebook_tools.py overrides for "
                    "jupyter/nbclient#312 (checked against nbclient 0.11.0): ")


def test_pin_replicate_copies_parameters_then_buffers_through_broadcast_coalesced_reshape():
    changed = TORCH_CHANGED.format("helpers/kit/dp_vs_ddp.py's torch_replicate_on_cpu (lesson 03)")
    replicate_module = sys.modules["torch.nn.parallel.replicate"]
    if not hasattr(replicate_module, "_broadcast_coalesced_reshape"):
        pytest.fail(changed + "torch.nn.parallel.replicate._broadcast_coalesced_reshape is gone")
    calls = []

    def on_cpu(tensors, devices, detach=False):  # what a GPU broadcast hands back: one list of copies per device
        calls.append([tuple(t.shape) for t in tensors])
        return [[t.detach().clone() if detach else t.clone() for t in tensors] for _ in devices]

    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    with mock.patch.object(replicate_module, "_broadcast_coalesced_reshape", on_cpu):
        replicas = torch.nn.parallel.replicate(model, [0, 1])
    parameters, buffers = [tuple(p.shape) for p in model.parameters()], [tuple(b.shape) for b in model.buffers()]
    assert calls[:1] == [parameters], changed + f"replicate() no longer copies the parameters first through it: {calls}"
    assert len(replicas) == 2 and all(len(list(r.modules())) == 3 for r in replicas), changed + "no replicas"
    assert [shape for call in calls[1:] for shape in call] == buffers, (
        changed + f"replicate() copies the buffers another way now: {calls[1:]}")


def test_pin_clip_grad_norm_calls_the_clipping_function_through_its_module():
    from torch.nn.utils import clip_grad

    changed = TORCH_CHANGED.format("helpers/lessons/amp.py's check_amp_train_step (lesson 04)")
    real = getattr(clip_grad, "_clip_grads_with_norm_", None)
    if real is None:
        pytest.fail(changed + "torch.nn.utils.clip_grad._clip_grads_with_norm_ is gone")
    seen = []
    layer = nn.Linear(3, 1)
    layer(torch.ones(2, 3)).sum().backward()
    clip_grad._clip_grads_with_norm_ = lambda *args, **kwargs: seen.append(1) or real(*args, **kwargs)
    try:
        torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.1)  # imported elsewhere, as a learner imports it
    finally:
        clip_grad._clip_grads_with_norm_ = real
    assert seen == [1], changed + ("clip_grad_norm_ no longer calls clip_grad._clip_grads_with_norm_ by its module "
                                   "global: the check would tell a right answer that clip_grad_norm_ was not called")


def test_pin_grad_scaler_keeps_each_optimizers_stage():
    from torch.amp.grad_scaler import OptState

    changed = TORCH_CHANGED.format("helpers/lessons/amp.py's check_amp_train_step (lesson 04)")
    layer = nn.Linear(3, 1)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(layer(torch.ones(2, 3)).sum()).backward()
    try:
        before = scaler._per_optimizer_states[id(optimizer)]["stage"]
        scaler.unscale_(optimizer)
        after = scaler._per_optimizer_states[id(optimizer)]["stage"]
    except (AttributeError, KeyError, TypeError) as error:
        pytest.fail(changed + f"GradScaler._per_optimizer_states[id(optimizer)]['stage'] is gone ({error!r})")
    assert (before, after) == (OptState.READY, OptState.UNSCALED), (
        changed + f"unscale_ now moves the stage from {before} to {after}")


def test_pin_the_elastic_agents_rank_assignment_reads_no_agent_state():
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent

    from helpers.lessons.ranks import torch_ranks

    changed = TORCH_CHANGED.format("helpers/lessons/ranks.py's torch_ranks (lesson 00's check)")
    method = getattr(SimpleElasticAgent, "_assign_worker_ranks", None)
    if method is None:
        pytest.fail(changed + "SimpleElasticAgent._assign_worker_ranks is gone")
    names = list(inspect.signature(method).parameters)
    assert names == ["self", "store", "group_rank", "group_world_size", "spec"], (
        changed + f"_assign_worker_ranks now takes {names}")
    try:  # called with self=None, one thread per agent, as torch_ranks does
        ranks = torch_ranks([2, 1], timeout=10)
    except (AttributeError, RuntimeError) as error:
        pytest.fail(changed + f"_assign_worker_ranks(None, ...) now reads the agent, or waits differently: {error!r}")
    assert ranks == {(0, 0): 0, (0, 1): 1, (1, 0): 2}, changed + f"ranks are now given out as {ranks}"


def test_pin_launch_config_counts_accelerators_only_when_one_is_available(monkeypatch):
    from torch.distributed import run as torchrun

    from helpers.launcher.agent import _config_without_touching_cuda

    changed = TORCH_CHANGED.format("helpers/launcher/agent.py's _config_without_touching_cuda (forked workers "
                                   "that may still initialise CUDA)")
    args = torchrun.get_args_parser().parse_args(["--nproc-per-node=2", "--standalone", "worker.py"])
    counted = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: counted.append(1) or 2)
    torchrun.config_from_args(args)
    assert counted, changed + ("config_from_args no longer counts accelerators (LaunchConfig's default NUMA "
                               "binding): the swap of torch.accelerator.is_available is no longer needed")
    counted.clear()
    _config_without_touching_cuda(torchrun, args)
    assert not counted, changed + ("config_from_args counts accelerators without asking "
                                   "torch.accelerator.is_available first: our swap no longer keeps CUDA untouched")
    assert torch.accelerator.is_available(), "the swap must be undone"


def test_pin_nbclient_still_calls_the_coroutines_the_runner_overrides():
    import nbclient

    from helpers.tools.notebook_tools import _client_class

    ours = _client_class()
    for name in ("_async_poll_for_reply", "_async_handle_timeout"):
        theirs = getattr(nbclient.NotebookClient, name, None)
        if theirs is None:
            pytest.fail(NBCLIENT_CHANGED + f"NotebookClient.{name} is gone: our override is dead code")
        assert list(inspect.signature(theirs).parameters) == list(inspect.signature(getattr(ours, name)).parameters), (
            NBCLIENT_CHANGED + f"NotebookClient.{name} now takes {inspect.signature(theirs)}")
    callers = {"async_execute_cell": "self._async_poll_for_reply(",
               "_async_poll_for_reply": "self._async_handle_timeout("}
    for caller, call in callers.items():
        assert call in inspect.getsource(getattr(nbclient.NotebookClient, caller)), (
            NBCLIENT_CHANGED + f"NotebookClient.{caller} no longer calls {call[5:-1]}: our override is dead code")
