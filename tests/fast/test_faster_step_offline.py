"""Lesson 13 without a launch: the byte formulas against torch's own rule, the missing-compiler message through
torch's own compiler lookup, the exercise check's sentences for each record a wrong hook leaves, the trace reader,
the FLOP formula against FlopCounterMode, and the graph counter on a real (tiny) torch.compile."""
from __future__ import annotations

import json
import os
import tempfile

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from helpers.kit import REPO_ROOT
from helpers.kit.faster_step import (
    NO_COMPILER,
    GraphCounter,
    NoCompiler,
    build_model,
    prepare_compile,
    require_cxx,
    still_working,
)
from helpers.lessons import faster_step
from helpers.lessons.faster_step import flops_formula, hook_bytes, hook_events, powersgd_split, trace_steps

SHAPES = [[10], [10, 256], [256], [256, 256], [256], [256, 784]]  # the hooks worker's model, back to front


@pytest.mark.parametrize("rank", [1, 2, 4, 300])
def test_powersgd_split_follows_torchs_own_rule(rank):
    """Our rebuild of _should_compress against torch's function, shape by shape (a rank of 300 compresses nothing)."""
    for shape in [*SHAPES, [3, 5, 7], [1, 1]]:
        n, m = shape[0], int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1
        ours = powersgd_split([shape], rank)
        compress, _, _ = _should_compress(n, m, min(n, m, rank), 2)
        assert (ours["P"] > 0) == compress, shape
        assert sum(ours.values()) == ((n + m) * min(n, m, rank) if compress else n * m)


def test_hook_bytes_for_every_setting():
    values = sum(int(torch.tensor(s).prod()) for s in SHAPES)
    assert hook_bytes("all-reduce", SHAPES) == 4 * values == 1_077_288
    assert hook_bytes("fp16", SHAPES) == hook_bytes("bf16", SHAPES) == 2 * values
    # r=1: P and Q of the three matrices, (n + m) values each, plus the 522 bias values
    assert hook_bytes("PowerSGD r=1", SHAPES) == 4 * ((10 + 256) + (256 + 256) + (256 + 784) + 522) == 9360


def test_no_compiler_is_said_in_one_sentence():
    """torch's own lookup (cpp_builder.get_cpp_compiler) with a compiler that does not exist: our message, not
    torch's InvalidCxxCompiler from inside the first compiled step."""
    import torch._inductor.config as config
    with config.patch({"cpp.cxx": (None, "no-such-c++-compiler-lesson13")}), pytest.raises(NoCompiler) as raised:
        require_cxx()
    message = str(raised.value)
    assert message.startswith(NO_COMPILER.split("{detail}")[0]) and "no-such-c++-compiler-lesson13" in message
    assert "apt-get install g++" in message and "restart the kernel" in message


def test_the_compiler_here_is_found():
    if not any(os.access(os.path.join(d, "g++"), os.X_OK) for d in os.environ.get("PATH", "").split(os.pathsep)):
        pytest.skip("no g++ on this machine: the lesson says so and skips inductor")
    assert require_cxx() == "g++"


def test_prepare_compile_keeps_caches_out_of_the_repository(monkeypatch):
    monkeypatch.setenv("MASTER_PORT", "12345")
    for name in ("TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_COMPILE_THREADS", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    cache = prepare_compile()
    import torch._inductor.config as config
    assert os.environ["TORCHINDUCTOR_COMPILE_THREADS"] == "1" and config.compile_threads == 1
    assert cache == os.environ["TORCHINDUCTOR_CACHE_DIR"] and cache.startswith(tempfile.gettempdir())
    assert not cache.startswith(str(REPO_ROOT)) and cache.endswith("12345")


def test_still_working_speaks_at_once_and_then_every_few_seconds(capsys):
    import time
    with still_working("compiling", every=0.05):
        time.sleep(0.18)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "compiling" and len(lines) >= 3 and "still working after" in lines[1]
    with still_working("silent", every=0.05, enabled=False):
        time.sleep(0.1)
    assert capsys.readouterr().out == ""


def good_step(values: int = 4426) -> dict:
    return {"buckets": [{"values": values, "dtype": "torch.float32"}], "error": 2.5e-3, "ratio": 1.0,
            "calls": [{"op": "all_reduce", "bytes": 2 * values}]}


RECORDS = {  # what faster_hook_check.py records on a rank for a wrong hook -> the words its message must hold
    "not a future": ({"problems": [{"kind": "not a future", "type": "Tensor"}]}, "returned a Tensor, not a"),
    "unfinished": ({"problems": [{"kind": "unfinished", "deadline": 10}]}, "still not complete 10 s later"),
    "callback raised": ({"problems": [{"kind": "failed future", "error": "NameError: x", "where": "h.py:9 (in cb)"}]},
                        "raised NameError: x at h.py:9 (in cb)"),
    "list value": ({"problems": [{"kind": "not a tensor", "type": "list"}]}, "holds a list, not one tensor"),
    "wrong shape": ({"problems": [{"kind": "shape", "shape": [10], "bucket_shape": [4426]}]}, "shape [4426]"),
    "wrong dtype": ({"problems": [{"kind": "dtype", "dtype": "torch.bfloat16", "bucket_dtype": "torch.float32"}]},
                    "cast the sum back to the bucket's dtype (torch.float32)"),
    "twice": ({"steps": [{**good_step(), "calls": [{"op": "all_reduce", "bytes": 8852}] * 2}]},
              "issued 2 all-reduce calls for 1 bucket"),
    "none": ({"steps": [{**good_step(), "calls": []}]}, "issued 0 all-reduce calls for 1 bucket"),
    "broadcast": ({"steps": [{**good_step(), "calls": [{"op": "broadcast", "bytes": 8852}]}]}, "called ['broadcast']"),
    "float32": ({"steps": [{**good_step(), "calls": [{"op": "all_reduce", "bytes": 17704}]}]},
                "handed 4 bytes per gradient value"),
    "int8": ({"steps": [{**good_step(), "calls": [{"op": "all_reduce", "bytes": 4426}]}]}, "handed 1 bytes per"),
    "not divided": ({"steps": [{**good_step(), "ratio": 2.0, "error": 1.0}]}, "2.00 times the exact average: divide"),
    "divided twice": ({"steps": [{**good_step(), "ratio": 0.5, "error": 0.5}]}, "divided by the number of ranks twice"),
    "wrong values": ({"steps": [{**good_step(), "ratio": 0.9, "error": 0.3}]}, "differ from the exact average"),
    "missing": ({"missing": True}, "defines no function compress_hook"),
    "crashed": ({"crashed": "ValueError: no"}, "crashed: ValueError: no"),
}


@pytest.mark.parametrize("name", RECORDS)
def test_each_wrong_record_gets_its_own_not_yet(name):
    record, words = RECORDS[name]
    full = {"missing": False, "problems": [], "steps": [good_step(), good_step()], **record}
    right = {"missing": False, "problems": [], "steps": [good_step()]}
    line = faster_step._verdict_line({0: right, 1: full}, "h.py", 2)
    assert line.startswith("Not yet: rank 1: ") and words in line, line


def test_a_right_record_is_correct_and_says_its_worst_error():
    line = faster_step._verdict_line({0: {"missing": False, "problems": [], "steps": [good_step()] * 3}}, "h.py", 2)
    assert line.startswith("Correct: h.py all-reduced 2 bytes per gradient value") and "2.5e-03" in line


def test_trace_steps_reads_a_chrome_trace(tmp_path):
    def event(name, ts, dur, tid=1):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1}
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        event("plain step", 1000, 500), event("autograd::engine::evaluate_function: AddmmBackward0", 1100, 50),
        event("c10d::allreduce_", 1120, 10), event("gloo:all_reduce", 1125, 600, tid=2),  # ends after the mark
        event("aten::mm", 1105, 20), {"ph": "i", "name": "marker", "ts": 1110},
        event("plain step", 3000, 100), event("autograd::engine::evaluate_function: X", 3010, 5),
        event("hooked step", 2000, 100), event("autograd::engine::evaluate_function: Y", 2010, 5)]}))
    steps = trace_steps(trace, "plain")
    assert [len(s) for s in steps] == [3, 1]
    assert [(e["kind"], e["start_us"], e["end_us"]) for e in steps[0]] == [
        ("backward", 0, 50), ("all-reduce issued", 20, 30), ("all-reduce running", 25, 625)]
    assert len(trace_steps(trace, "hooked")) == 1


def test_hook_events_are_relative_to_the_backward_call():
    events = hook_events({"backward_called": 10.0, "backward_returned": 10.01, "buckets": [
        {"called": 10.002, "returned": 10.003, "completed": 10.006}, {"called": 10.004, "returned": 10.005,
                                                                      "completed": 10.009}]})
    assert events[0]["kind"] == "backward" and events[0]["end_us"] == pytest.approx(4000)
    assert [round(e["start_us"]) for e in events[1:]] == [2000, 3000, 4000, 5000]


def test_flops_formula_equals_flop_counter_mode():
    from torch.utils.flop_counter import FlopCounterMode
    model, batch = build_model(32, 2), 8
    layers = [[m.in_features, m.out_features] for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(torch.rand(batch, 1, 28, 28)), torch.zeros(batch).long()).backward()
    assert counter.get_total_flops() == sum(flops_formula(layers, batch).values())


def test_graph_counter_counts_the_graphs_of_a_real_compile():
    torch._dynamo.reset()
    counter = GraphCounter("aot_eager")
    model = build_model(16, 2)
    compiled = torch.compile(model, backend=counter)
    compiled(torch.rand(4, 1, 28, 28)).sum().backward()
    compiled(torch.rand(4, 1, 28, 28))  # same shapes: no new graph
    torch._dynamo.reset()
    assert len(counter.graphs) == 1
    assert counter.graphs[0]["parameter_bytes"] == 4 * sum(p.numel() for p in model.parameters())
    assert counter.graphs[0]["collectives"] == []


def test_pin_ddp_optimizer_first_bucket_and_log_line():
    """Private parts of torch that lesson 13 reads (checked against torch 2.14.1): DDPOptimizer's first bucket of
    torch.distributed._DEFAULT_FIRST_BUCKET_BYTES (section 3's graph counts and its 0.25 MiB error) and its log
    line, which helpers/workers/faster_compile.py keeps and the notebook compares with its own count."""
    import inspect

    import torch.distributed as dist
    from torch._dynamo.backends import distributed as ddp_optimizer

    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 2**20
    with pytest.raises(AssertionError, match="First bucket should be smaller/equal to other buckets"):
        ddp_optimizer.DDPOptimizer(bucket_bytes_cap=2**18, backend_compile_fn=lambda gm, inputs: gm)
    assert "DDPOptimizer used bucket cap %s and created %d buckets" in inspect.getsource(
        ddp_optimizer.pretty_print_buckets)
    assert ddp_optimizer.log.name == "torch._dynamo.backends.distributed"
