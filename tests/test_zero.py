"""Lesson 09: the four checks accept the solutions, say "Not yet" on the starting code, and fire each message on a
wrong class (a mutated copy of helpers/workers/zero_solution.py). Each check is one real 2-rank launch (~5 s)."""
import json
import re
from pathlib import Path

import pytest
import torch

from helpers.kit.zero import alloc_storage, free_storage, padded_flat, shard_size, storage_bytes
from helpers.lessons.zero import check_step, expected, traffic

ROOT = Path(__file__).resolve().parent.parent
SOLUTION = ROOT / "helpers" / "workers" / "zero_solution.py"
NOTEBOOK = ROOT / "notebooks" / "09_build_zero.ipynb"

FRONT_PADDING = '''

def padded_flat(tensor, world_size):  # wrong: the zeros go in front
    flat = tensor.detach().reshape(-1)
    padding = -(-flat.numel() // world_size) * world_size - flat.numel()
    return torch.cat([flat.new_zeros(padding), flat])
'''

ALL_REDUCE_THEN_KEEP_SHARD = (
    "dist.reduce_scatter_single(summed, padded_flat(p.grad, self.world_size))",
    "full = padded_flat(p.grad, self.world_size)\n        dist.all_reduce(full)\n"
    "        summed = full.chunk(self.world_size)[self.rank].clone()")

STASH = (  # keeps the full gradients in a module-level global (neither .grad nor reachable from the class: the
    # memory checks do not see it, as the lesson says), reduce-scatters them in step(): the ordering check catches it
    ("        self._reduce_scatter(p)\n        p.grad = None  # the full gradient is freed during backward",
     "        globals().setdefault('_STASH', []).append((p, p.grad))\n        p.grad = None\n"
     "        self.shards[p].grad = torch.zeros_like(self.shards[p])  # the shard's gradient, preallocated"),
    ("    def step(self) -> None:\n        self.optimizer.step()\n"
     "        for p in self.params:\n            self._all_gather(p)",
     "    def step(self) -> None:\n        for p, grad in globals().pop('_STASH', []):\n            p.grad = grad\n"
     "            self._reduce_scatter(p)\n            p.grad = None\n        self.optimizer.step()\n"
     "        for p in self.params:\n            self._all_gather(p)"),
)

SUMMED = "after step 0's backward the gradient shard of 0.weight is 2 times DDP's averaged gradient"
NO_DIVISION = [("summed / self.world_size if shard.grad is None else shard.grad + summed / self.world_size",
                "summed if shard.grad is None else shard.grad + summed")]  # the reader's M7, in Zero1
NO_DIVISION_ON_ODD = [("summed / self.world_size if shard.grad is None",  # every tensor of `odd` has an odd size
                       "(summed if p.numel() % 2 else summed / self.world_size) if shard.grad is None")]

MUTATIONS = {
    # LL-1: AdamW hardly reacts to a gradient twice too large, so these are caught by step 0's gradients
    "bucketed, no division by the world size": (  # the reader's M6
        "bucketed", [("(flat / self.world_size)", "flat")],
        "model 'mlp': after step 0's backward the gradient of 0.weight is 2 times DDP's averaged gradient"),
    "bucketed, no division on a bucket of odd size (odd's only bucket)": (
        "bucketed", [("(flat / self.world_size)", "(flat / self.world_size if flat.numel() % 2 == 0 else flat)")],
        "model 'odd': after step 0's backward the gradient of 0.weight is 2 times DDP's averaged gradient"),
    "zero1, no division by the world size": ("zero1", NO_DIVISION, "model 'mlp': " + SUMMED),
    "zero2, no division by the world size": ("zero2", NO_DIVISION, "model 'mlp': " + SUMMED),
    "zero3, no division by the world size": ("zero3", NO_DIVISION, "model 'mlp': " + SUMMED),
    "zero1, no division on tensors of odd size (every tensor of odd)": (
        "zero1", NO_DIVISION_ON_ODD, "model 'odd': " + SUMMED),
    "zero1, never all-gathers the updated shards": (
        "zero1", [("        self.optimizer.step()\n        for p in self.params:\n            self._all_gather(p)\n\n"
                   "    def zero_grad", "        self.optimizer.step()\n\n    def zero_grad")],
        "after 5 AdamW steps the parameters differ from torch's DDP"),
    "bucketed, a bucket may not exceed the cap": (
        "bucketed", [("if size >= cap:", "if size + p.numel() * p.element_size() > cap and self.buckets[-1]:")],
        "the bucket plan"),
    "bucketed, all-reduces after backward": (
        "bucketed", [("dist.all_reduce(flat, async_op=True)", "None"),
                     ("            work.wait()\n            averages", "            dist.all_reduce(flat)\n"
                      "            averages")], "must start during backward"),
    "bucketed, an extra broadcast": (
        "bucketed", [("            work.wait()\n            averages", "            work.wait()\n"
                      "            dist.broadcast(flat, src=0)\n            averages")],
        "step 0 issued ['all_reduce', 'broadcast']; torch's DDP issued ['all_reduce'] in its steps of the same run"),
    "zero1, all-gathers twice": (
        "zero1", [("            self._all_gather(p)\n\n    def zero_grad",
                   "            self._all_gather(p)\n            self._all_gather(p)\n\n    def zero_grad")],
        "issued 12 all_gather calls moving 35408 bytes; the plan is 6 calls (one per parameter) moving 17704"),
    "zero1, an extra broadcast per parameter": (  # LL-5, the reader's M3
        "zero1", [("        alloc_storage(p)\n        p.data.copy_(full[: p.numel()].view_as(p))  # .data",
                   "        dist.broadcast(p.data, src=0)\n        alloc_storage(p)\n"
                   "        p.data.copy_(full[: p.numel()].view_as(p))  # .data")],
        "step 0 issued ['broadcast']; the plan is reduce-scatters and all-gathers only"),
    "zero1, padding in front": (
        "zero1", [("from helpers.kit.zero import alloc_storage, free_storage, padded_flat\n",
                   "from helpers.kit.zero import alloc_storage, free_storage\n" + FRONT_PADDING),
                  ("full[: p.numel()]", "full[full.numel() - p.numel():]")], "values [0, 18) of"),
    "zero1, the optimizer also keeps state for the full parameters": (
        "zero1", [("optimizer_class(list(self.shards.values()), **kwargs)",
                   "optimizer_class(list(self.shards.values()) + self.params, **kwargs)")], "bytes of Adam state"),
    "zero1, all-reduces then keeps its shard": ("zero1", [ALL_REDUCE_THEN_KEEP_SHARD], "all-reduced; reduce-scatter"),
    "zero2, all-reduces then keeps its shard": ("zero2", [ALL_REDUCE_THEN_KEEP_SHARD], "all-reduced; reduce-scatter"),
    "zero2, keeps the full gradients": (
        "zero2", [("        p.grad = None  # the full gradient is freed during backward", "")],
        "bytes of gradients after backward"),
    "zero2, reduce-scatters in step()": ("zero2", list(STASH), "reduce-scattered after backward"),
    "zero3, no prefetch": (
        "zero3", [("        self._start_gather(prefetch)  # the next unit's all-gather runs while this unit computes\n",
                   "")],
        "unit 1's all-gather was not issued by the start of unit 0's forward"),
    "zero3, gathers every unit at the start of forward": (  # LL-3, the reader's M1
        "zero3", [("        self._start_gather(prefetch)  # the next unit's all-gather runs while this unit computes\n",
                   "        for j in range(len(self.units)) if prefetch == 1 else [prefetch]:\n"
                   "            self._start_gather(j)\n")],
        "by the start of unit 0's forward this rank had issued all-gathers of 17704 bytes, more than units 0..1 need"),
    "zero3, no backward prefetch": (  # LL-4, the reader's M5
        "zero3", [("self._gather(i, prefetch=i - 1)", "self._gather(i, prefetch=-1)")],
        "unit 1's all-gather was not issued when unit 2's backward started (no backward prefetch)"),
    "zero3, frees the parameters in step(), not after their reduce-scatter": (  # LL-2, the reader's M2
        "zero3", [("        super()._gradient_ready(p)\n        free_storage(p)", "        super()._gradient_ready(p)"),
                  ("        self.optimizer.step()  # no all-gather: the next forward gathers each unit when it needs "
                   "it\n",
                   "        self.optimizer.step()\n        for p in self.params:\n            free_storage(p)\n")],
        "when backward ended this rank still held 17704 bytes of full parameters"),
    "zero3, never frees after forward": (
        "zero3", [("            unit.register_forward_hook(lambda module, args, output, i=i: self._free(i))\n", "")],
        "still held"),
    "zero3, all-gathers in step()": (
        "zero3", [("        self.optimizer.step()  # no all-gather: the next forward gathers each unit "
                   "when it needs it\n", "        super().step()\n")], "bytes of parameters after the step"),
    # the second fresh reader's wrong classes (fc09b)
    "zero1, an extra dist.reduce per parameter (NEW-2: every dist collective is logged)": (
        "zero1", [("        shard = self.shards[p]\n        summed",
                   "        dist.reduce(p.grad.clone(), dst=0)\n        shard = self.shards[p]\n        summed")],
        "model 'mlp': step 0 issued ['reduce']; the plan is reduce-scatters and all-gathers only"),
    "zero3, keeps every all-gather buffer (NEW-1)": (
        "zero3", [("                self.gathering[i].append((p, full, work))",
                   "                self.gathering[i].append((p, full, work))\n"
                   "                self.__dict__.setdefault('kept', {})[p] = full")],
        "step 0, when backward ended: the class and the model held 17704 bytes in 6 tensor storage(s) that are none "
        "of the parameters, gradients, shards, shards' gradients or optimizer state (the largest of shape [2304])"),
    "zero2, keeps the full gradients on the side (NEW-1)": (
        "zero2", [("        p.grad = None  # the full gradient is freed during backward",
                   "        self.__dict__.setdefault('kept', {})[p] = p.grad\n        p.grad = None")],
        "step 0, when backward ended: the class and the model held 17704 bytes in 6 tensor storage(s) that are none "
        "of the parameters, gradients, shards, shards' gradients or optimizer state (the largest of shape [48, 48])"),
    "zero3, starts the next unit's all-gather only after this unit's forward (NEW-4)": (
        "zero3", [("self._gather(i, prefetch=i + 1))", "self._gather(i, prefetch=-1))"),
                  ("lambda module, args, output, i=i: self._free(i))",
                   "lambda module, args, output, i=i: [self._start_gather(i + 1), self._free(i)] and None)")],
        "model 'mlp': step 0: unit 1's all-gather was not issued by the start of unit 0's forward (issue it before "
        "unit 0 computes"),
    "zero1, all-reduces the parameters in its constructor (NEW-3: only a broadcast may be issued there)": (
        "zero1", [("        self.optimizer = optimizer_class(list(self.shards.values()), **kwargs)",
                   "        self.optimizer = optimizer_class(list(self.shards.values()), **kwargs)\n"
                   "        for p in self.params:\n            dist.all_reduce(p.data)")],
        "building the zero1 class issued ['all_reduce']; a constructor may broadcast rank 0's parameters (torch's DDP "
        "constructor issued ['_broadcast_coalesced'] in the same run), nothing else."),
    # the third fresh reader's wrong classes (fc09c)
    "zero3, a blocking 'prefetch': all-gathers with async_op=False (NF-3)": (
        "zero3", [("                work = dist.all_gather_single(full, self.shards[p].detach(), async_op=True)",
                   "                dist.all_gather_single(full, self.shards[p].detach())\n"
                   "                work = torch.futures.Future()\n                work.set_result(None)")],
        "model 'mlp': step 0 issued 12 all-gathers with async_op=False; start every unit's all-gathers with "
        "async_op=True"),
}

BUFFER = ("the class and the model held 17704 bytes in 6 tensor storage(s) that are none of the parameters, gradients, "
          "shards, shards' gradients or optimizer state (the largest of shape ")
SUBCLASSES = {  # the third fresh reader's j_, k_ and m_ (fc09c): buffers kept on a tensor or in a closure (NF-1, NF-2)
    "zero3, keeps each gather buffer on its parameter": ("zero3", '''
class Zero3(Base):
    def _start_gather(self, i):
        if 0 <= i < len(self.units) and i not in self.gathering:
            self.gathering[i] = []
            for p in self.units[i].parameters():
                if not hasattr(p, "_full_padded"):
                    p._full_padded = torch.empty(self.world_size * self.shards[p].numel(), dtype=p.dtype)
                work = dist.all_gather_single(p._full_padded, self.shards[p].detach(), async_op=True)
                self.gathering[i].append((p, p._full_padded, work))
''', "step 0, when backward ended: " + BUFFER + "[2304])"),
    "zero3, keeps its gather buffers in a hook's closure": ("zero3", '''
class Zero3(Base):
    def __init__(self, model, units, optimizer_class, **kwargs):
        buffers = {}
        def start(i):
            if 0 <= i < len(self.units) and i not in self.gathering:
                self.gathering[i] = []
                for p in self.units[i].parameters():
                    full = buffers.setdefault(p, torch.empty(self.world_size * self.shards[p].numel()))
                    work = dist.all_gather_single(full, self.shards[p].detach(), async_op=True)
                    self.gathering[i].append((p, full, work))
        self._start_gather = start
        super().__init__(model, units, optimizer_class, **kwargs)
''', "step 0, when backward ended: " + BUFFER + "[2304])"),
    "zero2, keeps each full gradient on its shard": ("zero2", '''
class Zero2(Base):
    def _gradient_ready(self, p):
        self.shards[p]._full_grad = p.grad.detach().clone()
        super()._gradient_ready(p)
''', "step 0, when backward ended: " + BUFFER + "[48, 48])"),
}


@pytest.mark.parametrize("name", sorted(SUBCLASSES))
def test_check_sees_buffers_on_tensors_and_in_closures(name, tmp_path, capsys):
    stage, body, message = SUBCLASSES[name]
    base = {"zero2": "Zero2", "zero3": "Zero3"}[stage]
    path = tmp_path / "subclass.py"
    path.write_text("import torch\nimport torch.distributed as dist\n\n"
                    f"from helpers.workers.zero_solution import {base} as Base\n\n" + body)
    assert not check_step(stage, path)
    out = capsys.readouterr().out
    assert out.startswith("Not yet: rank 0, model 'mlp': ") and message in out, out


def test_private_all_gather_base_with_async_by_position_passes_as_all_gather_single(tmp_path, capsys):
    # NF-4: dist._all_gather_base is logged as the all_gather_single it calls; NF-3: async_op given by position counts
    path = mutated(tmp_path, [("dist.all_gather_single(full, self.shards[p].detach(), async_op=True)",
                               "dist._all_gather_base(full, self.shards[p].detach(), None, True)")])
    checked = check_step("zero3", path)
    assert checked, capsys.readouterr().out
    events = [e for e in checked.results[0]["models"]["mlp"]["impl"]["steps"][0] if e["op"] != "mark"]
    gathers = [e for e in events if e["op"] == "all_gather_single"]
    assert len(gathers) == 12 and all(e["async"] for e in gathers), events


CONSTRUCTOR_BROADCASTS = {  # the reader's b_ and g_: what DDP's constructor does, in ours; they must pass
    "bucketed": ("        self.ready, self.in_flight = [0] * len(self.buckets), []\n\n    def forward",
                 "        self.ready, self.in_flight = [0] * len(self.buckets), []\n"
                 "        for p in module.parameters():\n            dist.broadcast(p.data, src=0)\n\n    def forward"),
    "zero1": ("        self.params = [p for p in params if p.requires_grad]\n",
              "        self.params = [p for p in params if p.requires_grad]\n"
              "        for p in self.params:\n            dist.broadcast(p.data, src=0)\n"),
}


@pytest.mark.parametrize("stage", sorted(CONSTRUCTOR_BROADCASTS))
def test_a_broadcast_in_the_constructor_is_not_charged_to_step_0(stage, tmp_path, capsys):
    checked = check_step(stage, mutated(tmp_path, [CONSTRUCTOR_BROADCASTS[stage]]))
    assert checked, capsys.readouterr().out
    construction = checked.results[0]["models"]["mlp"]["construction"]
    assert [e["op"] for e in construction] == ["broadcast"] * 6  # logged apart from step 0, one per parameter


def mutated(tmp_path: Path, replacements: list[tuple[str, str]]) -> Path:
    source = SOLUTION.read_text()
    for old, new in replacements:
        assert source.count(old) >= 1, f"the solution no longer contains {old!r}"
        source = source.replace(old, new)
    path = tmp_path / "mutant.py"
    path.write_text(source)
    return path


@pytest.mark.parametrize("stage", ["bucketed", "zero1", "zero2", "zero3"])
def test_check_accepts_the_solution(stage, capsys):
    assert check_step(stage, SOLUTION)
    assert capsys.readouterr().out.startswith("Correct: ")


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_check_fires_its_message_on_a_wrong_class(name, tmp_path, capsys):
    stage, replacements, message = MUTATIONS[name]
    assert not check_step(stage, mutated(tmp_path, replacements))
    out = capsys.readouterr().out
    assert out.startswith("Not yet: ") and message in out, out


def test_parameters_alone_miss_a_sum_not_averaged_on_odd_and_tied(tmp_path, capsys):
    # why the check compares step 0's gradients (LL-1): AdamW's m / sqrt(v) cancels a constant gradient scale, so
    # after 5 steps a Zero1 that sums without dividing is within 1e-6 of DDP's parameters on odd and tied
    checked = check_step("zero1", mutated(tmp_path, NO_DIVISION))
    assert not checked and SUMMED in capsys.readouterr().out
    for got in checked.results.values():
        diffs = {name: model["max_diff"] for name, model in got["models"].items()}
        assert diffs["odd"] < 1e-6 and diffs["tied"] < 1e-6 < diffs["mlp"], diffs


def test_starting_code_in_the_notebook_says_not_yet(tmp_path, capsys):
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    files = {}
    for source in cells:
        match = re.match(r"%%writefile (\S+)\n", source)
        if match:
            files[match[1]] = source[match.end():]
            (tmp_path / match[1]).write_text(files[match[1]])
    stages = {"my_bucketed_ddp.py": "bucketed", "my_zero1.py": "zero1", "my_zero2.py": "zero2", "my_zero3.py": "zero3"}
    assert set(files) == set(stages)
    for file, stage in stages.items():
        assert not check_step(stage, tmp_path / file)
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 4 and all(line.startswith("Not yet: ") for line in out), out
    assert "the bucket plan" in out[0]  # the per-parameter all-reduce trains right but breaks the plan
    assert "`shards` should map every parameter" in out[1]  # plain data parallelism: right values, nothing sharded


def test_check_reports_a_crash_and_a_hang(tmp_path, capsys):
    crash = tmp_path / "crash.py"
    crash.write_text("class Zero1:\n    def __init__(self, *args, **kwargs):\n        raise RuntimeError('boom')\n")
    assert not check_step("zero1", crash)
    assert "the check failed with RuntimeError: boom" in capsys.readouterr().out
    hang = tmp_path / "hang.py"  # rank 0 waits in an all-reduce that rank 1 never joins
    hang.write_text("import torch, torch.distributed as dist\n\nclass Zero1:\n"
                    "    def __init__(self, *args, **kwargs):\n        if dist.get_rank() == 0:\n"
                    "            dist.all_reduce(torch.zeros(1))\n        import time; time.sleep(60)\n")
    assert not check_step("zero1", hang, timeout=15)
    assert "still running after 15 s" in capsys.readouterr().out


def test_shard_arithmetic_and_storage_helpers():
    assert [shard_size(n, 2) for n in (35, 5, 15, 4426)] == [18, 3, 8, 2213]
    flat = padded_flat(torch.arange(5.0), 2)
    assert flat.tolist() == [0, 1, 2, 3, 4, 0] and flat.chunk(2)[1].tolist() == [3, 4, 0]
    assert expected([35, 5, 15], 2) == {"params": 55, "shard": 29, "padding": 3, "adam_shard_bytes": 232,
                                        "grad_shard_bytes": 116, "param_shard_bytes": 116}
    weight = torch.ones(4, 4)
    view = weight[0]
    assert storage_bytes([weight, view]) == 64  # one storage, counted once
    free_storage(weight)
    assert storage_bytes([weight]) == 0 and weight.shape == (4, 4)
    alloc_storage(weight)
    assert storage_bytes([weight]) == 64


def test_traffic_counts_an_all_reduce_twice():
    events = [{"op": "all_reduce", "bytes": 100, "async": True}, {"op": "mark", "label": "backward end"},
              {"op": "reduce_scatter_single", "bytes": 100, "async": False},
              {"op": "all_gather_single", "bytes": 100, "async": False}]
    counts = traffic(events)
    assert counts["volume"] == 400 and counts["all_reduce calls"] == 1 and counts["all_gather_single bytes"] == 100


def test_a_learner_who_fills_in_the_four_files_passes(tmp_path, capsys):
    # the exercise path: my_zero2.py imports Zero1 from my_zero1.py beside it, my_zero3.py Zero2 from my_zero2.py
    import ast

    source = SOLUTION.read_text()
    classes = {node.name: ast.get_source_segment(source, node) for node in ast.parse(source).body
               if isinstance(node, ast.ClassDef)}
    header = ("import torch\nimport torch.distributed as dist\nfrom torch import nn\n\n"
              "from helpers.kit.zero import alloc_storage, free_storage, padded_flat\n")
    files = {"my_bucketed_ddp.py": ("", "BucketedDDP"), "my_zero1.py": ("", "Zero1"),
             "my_zero2.py": ("from my_zero1 import Zero1\n", "Zero2"),
             "my_zero3.py": ("from my_zero2 import Zero2\n", "Zero3")}
    for name, (imports, cls) in files.items():
        (tmp_path / name).write_text(header + imports + "\n\n" + classes[cls] + "\n")
    runs = {}
    for name, stage in zip(files, ("bucketed", "zero1", "zero2", "zero3"), strict=True):
        assert check_step(stage, tmp_path / name, keep=runs)
    assert sorted(runs) == ["bucketed", "zero1", "zero2", "zero3"]
    assert all(line.startswith("Correct: ") for line in capsys.readouterr().out.splitlines())
