"""Lesson 13 without a launch: the byte formulas against torch's own rule, the missing-compiler message through
torch's own compiler lookup, the exercise check's sentences for each record a wrong hook leaves, the trace reader,
the FLOP formula against FlopCounterMode, and the graph counter on a real (tiny) torch.compile."""
from __future__ import annotations

import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import _should_compress

from helpers.kit import REPO_ROOT
from helpers.kit.faster_step import (
    NO_COMPILER,
    GraphCounter,
    NoCompiler,
    build_model,
    fit_residual,
    prepare_compile,
    remove_compile_caches,
    require_cxx,
    still_working,
)
from helpers.lessons import faster_step
from helpers.lessons.faster_step import flops_formula, hook_bytes, powersgd_split, profile_table, trace_steps

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
    assert hook_bytes("PowerSGD r=1, no feedback", SHAPES) == 9360  # the control sends what its twin sends


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
    open(os.path.join(cache, "compiled.so"), "w").close()  # what inductor leaves there
    remove_compile_caches()  # what the workers call in their finally (atexit does not run in forked workers)
    assert not os.path.exists(cache)


def test_a_stopped_worker_removes_its_compile_cache(tmp_path):
    """Stop SIGTERMs a launch's workers; by default that skips the worker's `finally`, and an interrupted compile left
    its folder in /tmp (a walkthrough found one). The handler removes it and still ends the process by SIGTERM."""
    script = ("import os, signal, time\n"
              "from helpers.kit.faster_step import prepare_compile, remove_compile_caches_when_stopped\n"
              "remove_compile_caches_when_stopped()\n"
              "cache = prepare_compile()\n"
              "open(os.path.join(cache, 'compiled.so'), 'w').close()\n"
              "print(cache, flush=True)\n"
              "try:\n    time.sleep(60)\nfinally:\n    print('finally ran', flush=True)\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "MASTER_PORT": f"stopped-{os.getpid()}"}
    worker = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env,
                              cwd=tmp_path)
    cache = worker.stdout.readline().strip()
    assert os.path.isdir(cache)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == -signal.SIGTERM  # the launcher reads the same exit as before
    assert not os.path.exists(cache)


def test_still_working_speaks_at_once_and_then_every_few_seconds(capsys):
    import time
    with still_working("compiling", every=0.05):
        time.sleep(0.18)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "compiling" and len(lines) >= 3 and "still working after" in lines[1]
    with still_working("silent", every=0.05, enabled=False):
        time.sleep(0.1)
    assert capsys.readouterr().out == ""


def good_step(values: int = 4426, step: int = 0, where: str = "DDP's default group (3 ranks, process_group=None)",
              group_size: int = 3) -> dict:
    return {"step": step, "where": where, "group_size": group_size,
            "buckets": [{"values": values, "dtype": "torch.float32"}], "error": 2.5e-3, "ratio": 1.0,
            "calls": [{"op": "all_reduce", "bytes": 2 * values}], "every_rank_fit": 0.5, "every_rank_differs": 0.0,
            "own_fit": 0.6}


SUBGROUP = {"where": "a process group of 2 ranks that is not WORLD", "group_size": 2}
RECORDS = {  # what faster_hook_check.py records on a rank for a wrong hook -> the words its message must hold
    "torch's hook": ({"problems": [{"kind": "torch's hook", "function": "default_hooks.py (_compress_hook)"}]},
                     "let torch's own hook issue the all-reduce (default_hooks.py (_compress_hook)"),
    "not a future": ({"problems": [{"kind": "not a future", "type": "Tensor"}]}, "returned a Tensor, not a"),
    "unfinished": ({"problems": [{"kind": "unfinished", "deadline": 10}]}, "still not complete 10 s later"),
    "callback raised": ({"problems": [{"kind": "failed future", "error": "NameError: x", "where": "h.py:9 (in cb)"}]},
                        "raised NameError: x at h.py:9 (in cb)"),
    "no return": ({"problems": [{"kind": "not a tensor", "type": "NoneType"}]}, "your callback returned None"),
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
    "not divided": ({"steps": [{**good_step(), "ratio": 3.0, "error": 2.0}]}, "3.00 times the exact average: divide"),
    "divided twice": ({"steps": [{**good_step(), "ratio": 1 / 3, "error": 0.67}]},
                      "divided by the number of ranks twice"),
    "a 2 written down": ({"steps": [{**good_step(), "ratio": 1.5, "error": 0.5}]},
                         "divided by 2, but the group has 3 ranks: divide by the group's size"),
    "the world's size": ({"steps": [good_step(), {**good_step(step=1, **SUBGROUP), "ratio": 2 / 3, "error": 0.33}]},
                         "divided by 3, every rank's count (dist.get_world_size()); the group DDP handed your hook "
                         "has 2"),
    "the default group": ({"steps": [{**good_step(**SUBGROUP), "error": 0.4, "every_rank_fit": 0.003,
                                      "every_rank_differs": 0.4}]},
                          "the average over all 3 ranks, not over the 2 ranks of the group DDP handed your hook"),
    "float32 and the default group": (  # the starting code: both mistakes named, the group's after the bytes
        {"steps": [{**good_step(), "calls": [{"op": "all_reduce", "bytes": 17704}]},
                   {**good_step(**SUBGROUP), "calls": [{"op": "all_reduce", "bytes": 17704}], "error": 0.4,
                    "every_rank_fit": 0.003, "every_rank_differs": 0.4}]},
        "(2 bytes each) before the all-reduce. And in step 0 on a process group of 2 ranks that is not WORLD, DDP's "
        "gradients are (a multiple of) the average over all 3 ranks"),
    "float32, wrong on every group": (  # not a group mistake: the bytes alone are named
        {"steps": [{**good_step(), "calls": [{"op": "all_reduce", "bytes": 17704}], "ratio": 3.0, "error": 2.0},
                   {**good_step(**SUBGROUP), "calls": [{"op": "all_reduce", "bytes": 17704}], "ratio": 2.0,
                    "error": 1.0}]},
        "before the all-reduce."),
    "own values": ({"steps": [{**good_step(), "error": 0.75, "ratio": 0.4, "own_fit": 0.002}]},
                   "this rank's own gradients, scaled, not the all-reduced sum"),
    "wrong values": ({"steps": [{**good_step(), "ratio": 0.9, "error": 0.3}]}, "differ from the exact average"),
    "missing": ({"missing": True}, "defines no function compress_hook"),
    "crashed": ({"crashed": "ValueError: no"}, "crashed: ValueError: no"),
}


@pytest.mark.parametrize("name", RECORDS)
def test_each_wrong_record_gets_its_own_not_yet(name):
    record, words = RECORDS[name]
    full = {"missing": False, "problems": [], "steps": [good_step(), good_step(step=1)], **record}
    right = {"missing": False, "problems": [], "steps": [good_step()]}
    line = faster_step._verdict_line({0: right, 1: full}, "h.py", 3)
    assert line.startswith("Not yet: rank 1: ") and words in line, line
    if name == "float32, wrong on every group":
        assert line.endswith("before the all-reduce."), line


def test_a_rank_alone_in_its_group_may_return_its_own_gradient():
    """Rank 2 alone in a group of one: the exact average is its own gradient, so own_fit near 0 is right there."""
    alone = {**good_step(where="a process group of 1 rank that is not WORLD", group_size=1), "own_fit": 0.0}
    line = faster_step._verdict_line({2: {"missing": False, "problems": [], "steps": [good_step(), alone]}}, "h.py", 3)
    assert line.startswith("Correct: ") and "process groups that are not WORLD (1 rank)" in line, line


def test_a_right_record_is_correct_and_says_its_worst_error():
    line = faster_step._verdict_line({0: {"missing": False, "problems": [], "steps": [
        good_step(), {**good_step(step=0, **SUBGROUP)}]}}, "h.py", 3)
    assert line.startswith("Correct: h.py all-reduced 2 bytes per gradient value") and "2.5e-03" in line
    assert "on 3 ranks, on DDP's default group and on process groups that are not WORLD (2 ranks)" in line


def test_fit_residual_says_how_far_from_a_multiple():
    target = torch.tensor([1.0, 2.0, 3.0])
    assert fit_residual(0.5 * target, target) < 1e-6
    assert fit_residual(torch.tensor([3.0, -1.0, 0.0]), target) > 0.9
    assert fit_residual(torch.zeros(3), target) == 1.0


def event(name, ts, dur, tid=1, **args):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "pid": 1, "args": args}


def test_trace_steps_reads_a_chrome_trace(tmp_path):
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [
        event("plain step", 1000, 500), event("autograd::engine::evaluate_function: AddmmBackward0", 1100, 50),
        event("c10d::allreduce_", 1120, 10),
        event("gloo:all_reduce", 1125, 600, tid=2, **{"Input Dims": [[100]], "Input type": ["c10::Half"]}),
        event("aten::mm", 1105, 20), {"ph": "i", "name": "marker", "ts": 1110},
        event("plain step", 3000, 100), event("autograd::engine::evaluate_function: X", 3010, 5),
        event("hooked step", 2000, 100), event("autograd::engine::evaluate_function: Y", 2010, 5)]}))
    steps = trace_steps(trace, "plain")
    assert [len(s) for s in steps] == [3, 1]
    assert [(e["kind"], e["start_us"], e["end_us"], e["bytes"]) for e in steps[0]] == [
        ("backward", 0, 50, 0), ("all-reduce issued", 20, 30, 0), ("all-reduce running", 25, 625, 200)]
    assert len(trace_steps(trace, "hooked")) == 1


def test_profile_table_counts_issue_order_and_bytes_from_the_file(tmp_path):
    """Lesson 03's issue_order read from a trace file: two backward ops after the first issue of three; one after
    the last; float32 bytes; the training thread apart from gloo's."""
    trace = tmp_path / "trace.json"
    ops = [event("autograd::engine::evaluate_function: A", 1000 + 100 * i, 50) for i in range(3)]
    trace.write_text(json.dumps({"traceEvents": [
        event("4 buckets step", 900, 1000), *ops, event("c10d::allreduce_", 1060, 5),
        event("gloo:all_reduce", 1070, 400, tid=7, **{"Input Dims": [[10]], "Input type": ["float"]}),
        event("1 bucket step", 2900, 1000), *[{**e, "ts": e["ts"] + 2000} for e in ops],
        event("c10d::allreduce_", 3260, 5), event("gloo:all_reduce", 3270, 40, tid=7)]}))
    clocks = {"wall": [0.004, 0.002, 0.003], "cpu": [0.001, 0.001, 0.001]}
    table = profile_table({"trace": str(trace), "settings": ["4 buckets", "1 bucket"],
                           "backward": {"4 buckets": clocks, "1 bucket": clocks}})
    four, one = table["4 buckets"], table["1 bucket"]
    assert four["order"][0]["ops_after_first_issue"] == 2 and one["order"][0]["ops_after_first_issue"] == 0
    assert four["bytes"] == [40] and four["running_threads"] == [7] and four["backward_threads"] == [1]
    assert four["wall_ms"] == pytest.approx(3) and four["backward_span_ms"] == pytest.approx(0.25)


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


NOTEBOOK = REPO_ROOT / "notebooks" / "13_faster_step.ipynb"
TESTS = [REPO_ROOT / "tests" / "test_faster_step.py", Path(__file__)]


def _main_line(notebook: dict) -> str:
    text = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "markdown")
    return re.sub(r"<details>.*?</details>", "", text, flags=re.DOTALL)


def test_the_lesson_keeps_its_main_line_short_and_its_citations_folded():
    notebook = json.loads(NOTEBOOK.read_text())
    main = _main_line(notebook)
    assert len(main.split()) <= 3500, len(main.split())
    citations = re.findall(r"[\w/]+\.(?:py|cpp|h)(?::\d+|`?,? lines? \d+)", main)
    assert len(citations) <= 3, citations
    for cell in notebook["cells"]:  # no listing over 40 lines in the main line
        assert cell["cell_type"] == "markdown" or len("".join(cell["source"]).splitlines()) <= 40


def test_a_test_calls_every_helper_function_the_notebook_calls():
    """An import that breaks inside a helper (lesson 13 once imported a function lesson 03 had removed) must fail a
    test, not only the notebook: every function the notebook imports from helpers and calls is called in a test."""
    notebook = json.loads(NOTEBOOK.read_text())
    code = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"
                     and not "".join(c["source"]).startswith("%%"))
    imported = {alias.asname or alias.name for node in ast.walk(ast.parse(code)) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith("helpers.lessons.faster_step") for alias in node.names}
    called_in_notebook = {node.func.id for node in ast.walk(ast.parse(code))
                          if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    called_in_tests = {node.func.id for test in TESTS for node in ast.walk(ast.parse(test.read_text()))
                       if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)}
    used = imported & called_in_notebook
    assert len(used) >= 10 and not used - called_in_tests, sorted(used - called_in_tests)
