"""Lesson 09's classes under test: wrong ones a learner would write (each must hear a "Not yet" that names its
mistake) and right ones built differently (each must pass, or hear why the exercise excludes its design).

m01..m15 and c01..c09 are the wrong and right-but-different classes of the December mutation test
(../shared/reviews/2026-12-06-lesson09.md, part 2), rebuilt from its descriptions; W1..W4 and x1..x3 are the fresh
reader's of 6 December (lesson 09, findings 09-2 to 09-5); r09-2 marks the second reader's of that day (R1, R2),
w09-2 the learner walkthrough's; the others are earlier readers' (LL-, NEW-, NF-) and the lesson's own. Each class
is a copy of helpers/workers/zero_solution.py with a few lines changed (`mutated`), or a subclass of the solution's
class (`subclass`). WRONG and CRASHING map a name to (stage,
source, the words its message must contain: one string, or a tuple of strings that must all be in it, where a
measured difference sits between them); RIGHT to (stage, source).
"""
from __future__ import annotations

from pathlib import Path

SOLUTION = Path(__file__).resolve().parent.parent / "helpers" / "workers" / "zero_solution.py"


def mutated(*replacements: tuple[str, str]) -> str:
    source = SOLUTION.read_text()
    for old, new in replacements:
        assert source.count(old) >= 1, f"the solution no longer contains {old!r}"
        source = source.replace(old, new)
    return source


def subclass(stage: str, body: str) -> str:
    base = {"bucketed": "BucketedDDP", "zero1": "Zero1", "zero2": "Zero2", "zero3": "Zero3"}[stage]
    return ("import torch\nimport torch.distributed as dist\nfrom torch import nn\n\n"
            "from helpers.kit.zero import alloc_storage, free_storage, padded_flat\n"
            f"from helpers.workers.zero_solution import {base} as Base\n\n" + body)


NO_PREFETCH = ("        self._start_gather(prefetch)  # the next unit's all-gather runs while this unit computes\n", "")
RS_LINE = "dist.reduce_scatter_single(summed, padded_flat(p.grad, self.world_size))"
AVERAGE = "shard.grad = summed / self.world_size if shard.grad is None else shard.grad + summed / self.world_size"
ZERO1_STEP = ("        self.optimizer.step()\n        for p in self.params:\n            self._all_gather(p)\n\n"
              "    def zero_grad")
FRONT_PADDING = '''

def padded_flat(tensor, world_size):  # wrong: the zeros go in front
    flat = tensor.detach().reshape(-1)
    padding = -(-flat.numel() // world_size) * world_size - flat.numel()
    return torch.cat([flat.new_zeros(padding), flat])
'''
ONE_TOO_MANY = '''

def padded_flat(tensor, world_size):  # wrong: n // N + 1 values per rank, not ceil(n / N)
    flat = tensor.detach().reshape(-1)
    return torch.cat([flat, flat.new_zeros((flat.numel() // world_size + 1) * world_size - flat.numel())])
'''
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
AVG = RS_LINE.replace("))", "), op=dist.ReduceOp.AVG)")
SHARD_VIEW = ("chunk(self.world_size)[self.rank].clone())", "chunk(self.world_size)[self.rank])")
PADDED_COPY = ("model 'mlp': step 0, when backward ended: the shard of 2.weight is a view into a storage of 9216 "
               "bytes, of which your class's tensors use 4608: the other 4608 bytes are a copy kept alive behind the "
               "view. That storage is exactly 2.weight flattened and padded to 2 x 1152 values: padded_flat(p, N)"
               ".chunk(N)[r] is a view of that whole padded copy")
HELD = ("this check keeps the output of every async_op=True all-reduce, reduce-scatter and all-gather (list forms "
        "included; any part that another argument shares, such as an in-place all-gather's own chunk, excepted) at "
        "NaN until your code waits for it (on a real run that "
        "memory holds whatever it held before, or part of the result, depending on timing)")
BUFFER = ("the class and the model held 17704 bytes in 6 tensor storage(s) that are none of the parameters, gradients, "
          "shards, shards' gradients or optimizer state (the largest, of shape ")
GATHER_ONE = "        dist.all_gather_single(full, self.shards[p].detach())\n"
IN_PLACE = ("        mine = full.chunk(self.world_size)[self.rank]  # in place: this rank's chunk is the input\n"
            "        mine.copy_(self.shards[p].detach())\n"
            "        work = dist.all_gather_single(full, mine, async_op=True)\n")
ISSUE = "                work = dist.all_gather_single(full, self.shards[p].detach(), async_op=True)"
NOT_ISSUED = ("unit 1's all-gather was not issued by the start of unit 0's forward. On a CPU backend this process "
              "computes unit 0 before its next hook runs")

# ---------------------------------------------------------------------------- the December mutation test's classes

GROUPED = '''
def _rows(tensors, world_size):
    """Several padded tensors side by side, one row per rank: row r holds chunk r of each (the per-parameter
    shards stay the lesson's, and one collective moves them all)."""
    return torch.cat([padded_flat(t, world_size).view(world_size, -1) for t in tensors], dim=1)
'''

WRONG = {
    "m01 bucketed: gradients summed, not averaged": (
        "bucketed", mutated(("(flat / self.world_size)", "flat")),
        "model 'mlp': after step 0's backward the gradient of 0.weight is 2 times DDP's averaged gradient: divide"),
    "w09-3 bucketed: divided before the all-reduce's wait() (the sum lands over the division)": (
        "bucketed", mutated(("            work.wait()\n            averages = (flat / self.world_size).split(",
                             "            flat.div_(self.world_size)\n            work.wait()\n"
                             "            averages = flat.split(")),
        "model 'mlp': after step 0's backward the gradient of 0.weight is 2 times DDP's averaged gradient: divide the "
        "summed gradient by the world size, after the collective's wait()"),
    "m02 zero1: full Adam state on every rank (right collectives, shards and numbers)": (
        "zero1", mutated(("optimizer_class(list(self.shards.values()), **kwargs)",
                          "optimizer_class(list(self.shards.values()) + self.params, **kwargs)")),
        "model 'mlp': it holds 53112 bytes of Adam state; 8 bytes x shard = 17704"),
    "m03 zero2: the hook all-reduces the full gradient and keeps it": (
        "zero2", subclass("zero2", '''
class Zero2(Base):
    def _gradient_ready(self, p):
        dist.all_reduce(p.grad)
        p.grad /= self.world_size
        shard = self.shards[p]
        mine = padded_flat(p.grad, self.world_size).chunk(self.world_size)[self.rank]
        shard.grad = mine.clone() if shard.grad is None else shard.grad + mine
'''), "model 'mlp': step 0 all-reduced; reduce-scatter the gradients instead"),
    "m04 zero3: never frees a unit after its forward": (
        "zero3", mutated(("            unit.register_forward_hook(lambda module, args, output, i=i: self._free(i))\n",
                          "")),
        "model 'mlp': step 0: after unit 1's forward this rank still held 15744 bytes of full parameters; free each"),
    "m05b zero1: shards of n // N + 1 values": (
        "zero1", mutated(("from helpers.kit.zero import alloc_storage, free_storage, padded_flat\n",
                          "from helpers.kit.zero import alloc_storage, free_storage\n" + ONE_TOO_MANY)),
        "model 'mlp': right after the constructor, rank 0's shard of 0.weight (1536 values) should be values "
        "[0, 768) of the flattened parameter, zero-padded to 1536: S = ⌈1536/2⌉ = 768 values; it holds 769."),
    "m06 zero1: each rank keeps the next rank's shard": (
        "zero1", mutated(("chunk(self.world_size)[self.rank].clone())",
                          "chunk(self.world_size)[(self.rank + 1) % self.world_size].clone())")),
        "model 'mlp': right after the constructor, rank 0's shard of 0.weight (1536 values) should be values "
        "[0, 768) of the flattened parameter, zero-padded to 1536; it holds chunk 1, values [768, 1536): rank r "
        "keeps chunk r."),
    "m07 zero1: rank 0's buffer broadcast instead of an all-gather": (
        "zero1", mutated(("        dist.all_gather_single(full, self.shards[p].detach())",
                          "        size = self.shards[p].numel()\n"
                          "        full[self.rank * size:(self.rank + 1) * size] = self.shards[p].detach()\n"
                          "        dist.broadcast(full, src=0)")),
        "model 'mlp': step 0 issued ['broadcast']; the plan is reduce-scatters and all-gathers only"),
    "m08 zero3: backward prefetches unit i+1 instead of i-1": (
        "zero3", mutated(("self._gather(i, prefetch=i - 1)", "self._gather(i, prefetch=i + 1)")),
        "model 'mlp': step 0: unit 1's all-gather was not issued when unit 2's backward started (no backward "
        "prefetch: backward runs the units from last to first"),
    "m09 bucketed: every bucket all-reduced twice": (
        "bucketed", mutated(("            self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))",
                             "            dist.all_reduce(flat, async_op=True).wait()\n"
                             "            self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))")),
        "model 'mlp': step 0 all-reduced buckets of [11368, 11368, 6336, 6336] bytes; the bucket plan"),
    "m10 zero1: zero_grad never clears the full .grad": (
        "zero1", mutated(("        for p in self.params:\n            p.grad = None\n"
                          "        self.optimizer.zero_grad()", "        self.optimizer.zero_grad()")),
        "model 'mlp': after step 1's backward the gradient shard of 0.weight differs from DDP's by up to"),
    "m11 bucketed: the bucket counters are never reset": (
        "bucketed", subclass("bucketed", '''
class BucketedDDP(Base):
    def finish_gradient_synchronization(self):
        ready = self.ready
        super().finish_gradient_synchronization()
        self.ready = ready  # never reset: no bucket is full again
'''), "model 'mlp': step 1 all-reduced no bucket, though step 0 did: did you reset the per-bucket counts"),
    "m12 zero2: the hook overwrites the shard's gradient instead of adding to it": (
        "zero2", mutated((AVERAGE, "shard.grad = summed / self.world_size")),
        "model 'mlp': step 3 runs two backward passes before step() (gradient accumulation); after them the "
        "gradient shard of 0.weight differs from DDP's, which adds up both passes"),
    "m13 zero1: an async reduce-scatter never waited for": (
        "zero1", mutated((RS_LINE, RS_LINE.replace("))", "), async_op=True)"))),
        "model 'mlp': step 0 issued 6 reduce_scatter_single call(s) with async_op=True and never waited for them"),
    "m14 zero3: the prefetch is waited for at once": (
        "zero3", mutated(("        self._start_gather(prefetch)  # the next unit's all-gather runs while this unit "
                          "computes\n",
                          "        self._start_gather(prefetch)\n"
                          "        for _, _, work in self.gathering.get(prefetch, []):\n            work.wait()\n")),
        "model 'mlp': step 0: unit 1's all-gather was issued before unit 0 computed, and waited for before unit 0 "
        "computed too: a prefetch waited for at once overlaps nothing"),
    "m15 zero3: gather buffers kept in a class attribute": (
        "zero3", subclass("zero3", '''
class Zero3(Base):
    cache = {}  # one buffer per parameter, "for reuse"

    def _start_gather(self, i):
        if 0 <= i < len(self.units) and i not in self.gathering:
            self.gathering[i] = []
            for p in self.units[i].parameters():
                full = Zero3.cache.setdefault(p, torch.empty(self.world_size * self.shards[p].numel()))
                work = dist.all_gather_single(full, self.shards[p].detach(), async_op=True)
                self.gathering[i].append((p, full, work))
'''), "model 'mlp': step 0, when backward ended: " + BUFFER + "[2304], at Zero3.cache[<tensor>])"),
    # the right-but-different designs this exercise excludes, each told why
    "c01 zero1: one flat buffer for the whole model, no per-parameter shards": (
        "zero1", subclass("zero1", '''
class Zero1:
    def __init__(self, params, optimizer_class, **kwargs):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.params = [p for p in params if p.requires_grad]
        self.shards = {}  # one flat shard of the whole model instead
        self.flat = nn.Parameter(padded_flat(torch.cat([p.detach().reshape(-1) for p in self.params]),
                                             self.world_size).chunk(self.world_size)[self.rank].clone())
        self.optimizer = optimizer_class([self.flat], **kwargs)

    def step(self):
        grads = padded_flat(torch.cat([p.grad.reshape(-1) for p in self.params]), self.world_size)
        summed = torch.empty_like(self.flat)
        dist.reduce_scatter_single(summed, grads)
        self.flat.grad = summed / self.world_size
        self.optimizer.step()
        full = torch.empty(self.world_size * self.flat.numel())
        dist.all_gather_single(full, self.flat.detach())
        for p, values in zip(self.params, full.split([p.numel() for p in self.params] + [full.numel()
                             - sum(p.numel() for p in self.params)])):
            p.data.copy_(values.view_as(p))

    def zero_grad(self):
        for p in self.params:
            p.grad = None
        self.optimizer.zero_grad()
'''), "model 'mlp': `shards` should map every parameter to this rank's shard (one shard per parameter: the layout "
      "this exercise grades)."),
    "c03 zero2: async reduce-scatters kept pending in a list, waited for in step()": (
        "zero2", subclass("zero2", '''
class Zero2(Base):
    def __init__(self, *args, **kwargs):
        self.pending = []
        super().__init__(*args, **kwargs)

    def _gradient_ready(self, p):
        out = torch.empty_like(self.shards[p])
        self.pending.append((p, out, dist.reduce_scatter_single(out, padded_flat(p.grad, self.world_size),
                                                                 async_op=True)))
        p.grad = None

    def step(self):
        for p, out, work in self.pending:
            work.wait()
            shard = self.shards[p]
            shard.grad = out / self.world_size if shard.grad is None else shard.grad + out / self.world_size
        self.pending = []
        super().step()
'''), "model 'mlp': it holds 0 bytes of gradients after backward; 4 bytes x shard = 8852 (2213 values per rank). "
      "When backward returns, each shard's averaged gradient must be in its .grad"),
    "c03b zero2: async reduce-scatters straight into the shard's .grad, divided in step()": (
        "zero2", subclass("zero2", '''
class Zero2(Base):
    def __init__(self, *args, **kwargs):
        self.pending = []
        super().__init__(*args, **kwargs)

    def _gradient_ready(self, p):
        shard = self.shards[p]
        if shard.grad is None:
            shard.grad = torch.zeros_like(shard)
        self.pending.append(dist.reduce_scatter_single(shard.grad, padded_flat(p.grad, self.world_size),
                                                       async_op=True))
        p.grad = None

    def step(self):
        for work in self.pending:
            work.wait()
        self.pending = []
        for shard in self.shards.values():
            shard.grad /= self.world_size
        super().step()
'''), "model 'mlp': step 3 runs two backward passes before step() (gradient accumulation); after them the "
      "gradient shard of 0.weight differs from DDP's, which adds up both passes"),
    "c04 zero3: frees by swapping p.data for an empty tensor": (
        "zero3", subclass("zero3", '''
class Zero3(Base):
    def __init__(self, model, units, optimizer_class, **kwargs):
        self.shapes = {p: p.shape for p in model.parameters()}
        super().__init__(model, units, optimizer_class, **kwargs)
        for p in self.params:
            p.data = torch.empty(0)

    def _gather(self, i, prefetch):
        self._start_gather(i)
        self._start_gather(prefetch)
        for p, full, work in self.gathering.pop(i):
            work.wait()
            p.data = full[: self.shapes[p].numel()].view(self.shapes[p]).clone()

    def _free(self, i):
        for p in self.units[i].parameters():
            p.data = torch.empty(0)

    def _gradient_ready(self, p):
        self._reduce_scatter(p)
        p.grad = None
        p.data = torch.empty(0)
'''), "model 'mlp': after the constructor 0.weight has shape [0], where the model's parameter has [48, 32]: free the "
      "storage with free_storage(p), not by replacing p.data"),
    "w09-2 zero3: frees with p.data = torch.empty(0), gathers with alloc_storage and copy_": (
        "zero3", mutated(("free_storage(p)", "p.data = torch.empty(0)")),
        "model 'mlp': after the constructor 0.weight has shape [0], where the model's parameter has [48, 32]: free the "
        "storage with free_storage(p), not by replacing p.data"),
    "w09-2 zero3: frees with free_storage in the constructor, with p.data = torch.empty(0) after each forward": (
        "zero3", mutated(("            free_storage(p)\n\n    def _gradient_ready",
                          "            p.data = torch.empty(0)\n\n    def _gradient_ready")),
        "model 'mlp': at step 0, when unit 2's backward was about to run, 4.weight has shape [0], where the model's "
        "parameter has [10, 48]: free the storage with free_storage(p), not by replacing p.data"),
    "c05 zero1: each rank broadcasts its own shard (ZeroRedundancyOptimizer's way)": (
        "zero1", mutated(("        dist.all_gather_single(full, self.shards[p].detach())",
                          "        size = self.shards[p].numel()\n"
                          "        full[self.rank * size:(self.rank + 1) * size] = self.shards[p].detach()\n"
                          "        for owner in range(self.world_size):\n"
                          "            dist.broadcast(full[owner * size:(owner + 1) * size], src=owner)")),
        "model 'mlp': step 0 issued ['broadcast']; the plan is reduce-scatters and all-gathers only: gather every "
        "rank's shard with dist.all_gather_single."),
    "c07 zero3: FSDP2's default, no forward prefetch (backward prefetch kept)": (
        "zero3", mutated(("self._gather(i, prefetch=i + 1)", "self._gather(i, prefetch=-1)")),
        "model 'mlp': step 0: " + NOT_ISSUED),
    # earlier readers' wrong classes
    "bucketed: no division on a bucket of odd size (odd's only bucket)": (
        "bucketed", mutated(("(flat / self.world_size)",
                             "(flat / self.world_size if flat.numel() % 2 == 0 else flat)")),
        "model 'odd': after step 0's backward the gradient of 0.weight is 2 times DDP's averaged gradient"),
    "zero1: no division by the world size (LL-1)": ("zero1", mutated((AVERAGE, AVERAGE.replace(
        " / self.world_size", ""))), "model 'mlp': " + SUMMED),
    "zero2: no division by the world size": ("zero2", mutated((AVERAGE, AVERAGE.replace(" / self.world_size", ""))),
                                             "model 'mlp': " + SUMMED),
    "zero3: no division by the world size": ("zero3", mutated((AVERAGE, AVERAGE.replace(" / self.world_size", ""))),
                                             "model 'mlp': " + SUMMED),
    "zero1: no division on tensors of odd size (every tensor of odd)": (
        "zero1", mutated(("summed / self.world_size if shard.grad is None",
                          "(summed if p.numel() % 2 else summed / self.world_size) if shard.grad is None")),
        "model 'odd': " + SUMMED),
    "zero1: never all-gathers the updated shards": (
        "zero1", mutated((ZERO1_STEP, "        self.optimizer.step()\n\n    def zero_grad")),
        "model 'mlp': step 0 issued 0 all_gather calls moving 0 bytes; the plan is one per parameter"),
    "bucketed: a bucket may not exceed the cap": (
        "bucketed", mutated(("if size >= cap:", "if size + p.numel() * p.element_size() > cap and self.buckets[-1]:")),
        "model 'mlp': step 0 all-reduced buckets of [2152, 9408, 6144] bytes; the bucket plan"),
    "bucketed: all-reduces after backward": (
        "bucketed", mutated(("dist.all_reduce(flat, async_op=True)", "None"),
                            ("            work.wait()\n            averages",
                             "            dist.all_reduce(flat)\n            averages")),
        "model 'mlp': the all-reduces must start during backward"),
    "bucketed: the hook waits for its all-reduce at once": (
        "bucketed", mutated(("            self.in_flight.append((i, flat, dist.all_reduce(flat, async_op=True)))",
                             "            work = dist.all_reduce(flat, async_op=True)\n            work.wait()\n"
                             "            self.in_flight.append((i, flat, work))")),
        "model 'mlp': a bucket's all-reduce was waited for during backward, in the gradient hook"),
    "bucketed: an extra broadcast": (
        "bucketed", mutated(("            work.wait()\n            averages",
                             "            work.wait()\n            dist.broadcast(flat, src=0)\n            averages")),
        "model 'mlp': step 0 issued ['all_reduce', 'broadcast']; torch's DDP issued ['all_reduce'] in its steps"),
    "zero1: all-gathers twice": (
        "zero1", mutated(("            self._all_gather(p)\n\n    def zero_grad",
                          "            self._all_gather(p)\n            self._all_gather(p)\n\n    def zero_grad")),
        "model 'mlp': step 0 issued 12 all_gather calls moving 35408 bytes; the plan is one per parameter (6 calls, "
        "or fewer when you group parameters into one call) moving 17704 bytes."),
    "zero1: an extra broadcast per parameter (LL-5)": (
        "zero1", mutated(("        alloc_storage(p)\n        p.data.copy_(full[: p.numel()].view_as(p))  # .data",
                          "        dist.broadcast(p.data, src=0)\n        alloc_storage(p)\n"
                          "        p.data.copy_(full[: p.numel()].view_as(p))  # .data")),
        "model 'mlp': step 0 issued ['broadcast']; the plan is reduce-scatters and all-gathers only"),
    "zero1: padding in front": (
        "zero1", mutated(("from helpers.kit.zero import alloc_storage, free_storage, padded_flat\n",
                          "from helpers.kit.zero import alloc_storage, free_storage\n" + FRONT_PADDING),
                         ("full[: p.numel()]", "full[full.numel() - p.numel():]")),
        "model 'odd': right after the constructor, rank 0's shard of 0.weight (35 values) should be values [0, 18) "
        "of the flattened parameter, zero-padded to 36; it holds a chunk of the parameter padded in front"),
    "zero1: all-reduces, then keeps its shard": (
        "zero1", mutated((RS_LINE, "full = padded_flat(p.grad, self.world_size)\n        dist.all_reduce(full)\n"
                          "        summed = full.chunk(self.world_size)[self.rank].clone()")),
        "model 'mlp': step 0 all-reduced; reduce-scatter the gradients instead"),
    "zero2: keeps the full gradients": (
        "zero2", mutated(("        p.grad = None  # the full gradient is freed during backward", "")),
        ("model 'mlp': it holds 26556 bytes of gradients after backward; 4 bytes x shard = 8852",
         "The full gradients (17704 bytes) are still held: set p.grad = None in the hook")),
    "zero2: reduce-scatters in step()": (
        "zero2", mutated(*STASH), "model 'mlp': step 0 reduce-scattered after backward"),
    "zero3: no prefetch at all": ("zero3", mutated(NO_PREFETCH), "model 'mlp': step 0: " + NOT_ISSUED),
    "zero3: gathers every unit at the start of forward (LL-3)": (
        "zero3", mutated((NO_PREFETCH[0], "        for j in range(len(self.units)) if prefetch == 1 else [prefetch]:\n"
                                          "            self._start_gather(j)\n")),
        "model 'mlp': step 0: by the start of unit 0's forward this rank had issued all-gathers of 17704 bytes, more "
        "than units 0..1 need"),
    "zero3: no backward prefetch (LL-4)": (
        "zero3", mutated(("self._gather(i, prefetch=i - 1)", "self._gather(i, prefetch=-1)")),
        "model 'mlp': step 0: unit 1's all-gather was not issued when unit 2's backward started (no backward "
        "prefetch"),
    "zero3: frees the parameters in step(), not after their reduce-scatter (LL-2)": (
        "zero3", mutated(("        super()._gradient_ready(p)\n        free_storage(p)",
                          "        super()._gradient_ready(p)"),
                         ("        self.optimizer.step()  # no all-gather: the next forward gathers each unit when it "
                          "needs it\n",
                          "        self.optimizer.step()\n        for p in self.params:\n"
                          "            free_storage(p)\n")),
        "model 'mlp': step 0: when backward ended this rank still held 17704 bytes of full parameters"),
    "zero3: all-gathers in step()": (
        "zero3", mutated(("        self.optimizer.step()  # no all-gather: the next forward gathers each unit "
                          "when it needs it\n", "        super().step()\n")),
        "model 'mlp': step 0 all-gathered after backward, in step(): ZeRO-3 gathers each unit just before it runs"),
    "zero1: an extra dist.reduce per parameter (NEW-2)": (
        "zero1", mutated(("        shard = self.shards[p]\n        summed",
                          "        dist.reduce(p.grad.clone(), dst=0)\n        shard = self.shards[p]\n"
                          "        summed")),
        "model 'mlp': step 0 issued ['reduce']; the plan is reduce-scatters and all-gathers only"),
    "zero3: keeps every all-gather buffer in an instance dict (NEW-1)": (
        "zero3", mutated(("                self.gathering[i].append((p, full, work))",
                          "                self.gathering[i].append((p, full, work))\n"
                          "                self.__dict__.setdefault('kept', {})[p] = full")),
        "model 'mlp': step 0, when backward ended: " + BUFFER + "[2304], at Zero3.kept[<tensor>])"),
    "zero2: keeps the full gradients on the side (NEW-1)": (
        "zero2", mutated(("        p.grad = None  # the full gradient is freed during backward",
                          "        self.__dict__.setdefault('kept', {})[p] = p.grad\n        p.grad = None")),
        "model 'mlp': step 0, when backward ended: " + BUFFER + "[48, 48], at Zero2.kept[<tensor>])"),
    "zero3: starts the next unit's all-gather only after this unit's forward (NEW-4)": (
        "zero3", mutated(("self._gather(i, prefetch=i + 1))", "self._gather(i, prefetch=-1))"),
                         ("lambda module, args, output, i=i: self._free(i))",
                          "lambda module, args, output, i=i: [self._start_gather(i + 1), self._free(i)] and None)")),
        "model 'mlp': step 0: " + NOT_ISSUED),
    "zero1: all-reduces the parameters in its constructor (NEW-3)": (
        "zero1", mutated(("        self.optimizer = optimizer_class(list(self.shards.values()), **kwargs)",
                          "        self.optimizer = optimizer_class(list(self.shards.values()), **kwargs)\n"
                          "        for p in self.params:\n            dist.all_reduce(p.data)")),
        "model 'mlp': building the zero1 class issued ['all_reduce']; a constructor may broadcast rank 0's "
        "parameters (torch's DDP constructor issued ['_broadcast_coalesced'] in the same run), nothing else."),
    "zero3: a blocking 'prefetch', all-gathers with async_op=False (NF-3)": (
        "zero3", mutated(("                work = dist.all_gather_single(full, self.shards[p].detach(), async_op=True)",
                          "                dist.all_gather_single(full, self.shards[p].detach())\n"
                          "                work = torch.futures.Future()\n                work.set_result(None)")),
        "model 'mlp': step 0 issued 12 all-gathers with async_op=False; start every unit's all-gathers with "
        "async_op=True"),
    "zero3: keeps each gather buffer on its parameter (NF-1)": ("zero3", subclass("zero3", '''
class Zero3(Base):
    def _start_gather(self, i):
        if 0 <= i < len(self.units) and i not in self.gathering:
            self.gathering[i] = []
            for p in self.units[i].parameters():
                if not hasattr(p, "_full_padded"):
                    p._full_padded = torch.empty(self.world_size * self.shards[p].numel(), dtype=p.dtype)
                work = dist.all_gather_single(p._full_padded, self.shards[p].detach(), async_op=True)
                self.gathering[i].append((p, p._full_padded, work))
'''), "model 'mlp': step 0, when backward ended: " + BUFFER + "[2304], at Zero3.params[2]._full_padded)"),
    "zero3: keeps its gather buffers in a hook's closure (NF-2)": ("zero3", subclass("zero3", '''
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
'''), "model 'mlp': step 0, when backward ended: " + BUFFER + "[2304], at "),
    "zero2: keeps each full gradient on its shard (NF-1)": ("zero2", subclass("zero2", '''
class Zero2(Base):
    def _gradient_ready(self, p):
        self.shards[p]._full_grad = p.grad.detach().clone()
        super()._gradient_ready(p)
'''), "model 'mlp': step 0, when backward ended: " + BUFFER + "[48, 48], at "),
    # the fresh reader's classes of 6 December (lesson 09's review, 09-3 to 09-5)
    "W1 zero2: ReduceOp.AVG, then divided by N again (averaged twice)": (
        "zero2", mutated((RS_LINE, AVG)),
        "model 'mlp': after step 0's backward the gradient shard of 0.weight is 1/2 of DDP's averaged gradient: it was "
        "divided by the world size twice (op=ReduceOp.AVG already divides the sum by it); divide once."),
    "W2 zero1: the shard a view of padded_flat's whole copy (no .clone())": ("zero1", mutated(SHARD_VIEW), PADDED_COPY),
    "W2b zero2: the shard a view of padded_flat's whole copy (no .clone())": ("zero2", mutated(SHARD_VIEW),
                                                                              PADDED_COPY),
    "W3 zero3: each gather buffer copied into its parameter as soon as issued, waited for later": (
        "zero3", mutated(("                self.gathering[i].append((p, full, work))",
                          "                alloc_storage(p)\n"
                          "                p.data.copy_(full[: p.numel()].view_as(p))  # copied as soon as issued\n"
                          "                self.gathering[i].append((p, full, work))"),
                         ("            work.wait()\n            alloc_storage(p)\n"
                          "            p.data.copy_(full[: p.numel()].view_as(p))", "            work.wait()")),
        "model 'mlp': step 0: unit 0 started its forward with 0.weight, 0.bias holding NaN, though every shard was "
        "right: " + HELD + ", so your class copied a gathered buffer into the parameter before waiting for its "
        "all-gather."),
    "x1 zero1: all-gathers before the optimizer step": (
        "zero1", mutated(("            self._reduce_scatter(p)\n        self.optimizer.step()\n"
                          "        for p in self.params:\n            self._all_gather(p)\n",
                          "            self._reduce_scatter(p)\n        for p in self.params:\n"
                          "            self._all_gather(p)\n        self.optimizer.step()\n")),
        ("model 'mlp': after step 0 the parameters differ from torch's DDP by up to ",
         ", though the shards equal DDP's updated values: 0.weight still holds its values from before this step's "
         "update: all-gather the shards after self.optimizer.step() has updated them")),
    "x2 zero1: unpads the gathered buffer from its end (09-4)": (
        "zero1", mutated(("p.data.copy_(full[: p.numel()].view_as(p))  # .data",
                          "p.data.copy_(full[full.numel() - p.numel():].view_as(p))  # .data")),
        ("model 'odd': after step 0 the parameters differ from torch's DDP by up to ",
         ", though the shards equal DDP's updated values: 0.weight holds values [1, 36) of DDP's updated 0.weight "
         "gathered and padded to 36 values, where the parameter is the first 35, [0, 35): the padding sits at the end "
         "of the gathered buffer, so copy its first p.numel() values (full[:p.numel()]).")),
    "x3 bucketed: the averages copied before the all-reduce is waited for": (
        "bucketed", mutated(("            work.wait()\n            averages", "            averages"),
                            ("                q.grad.copy_(average.view_as(q))\n",
                             "                q.grad.copy_(average.view_as(q))\n            work.wait()\n")),
        "model 'mlp': after step 0's backward the gradient of 0.weight holds NaN: " + HELD + ", so NaN here means a "
        "buffer was read before its wait(): in finish_gradient_synchronization, wait() for a bucket's all-reduce "
        "before you divide and copy it."),
    # the second reader's classes of 6 December (r09-2, findings R1 and R2)
    "r09-2 zero3: every parameter kept gathered through backward, all freed when the last gradient is out": (
        "zero3", subclass("zero3", '''
class Zero3(Base):
    def __init__(self, *args, **kwargs):
        self.ready = 0
        super().__init__(*args, **kwargs)

    def _gradient_ready(self, p):
        super(Base, self)._gradient_ready(p)  # Zero2's: reduce-scatter, p.grad = None; no free here
        self.ready += 1
        if self.ready == len(self.params):  # the step's last gradient: free every parameter now
            self.ready = 0
            for q in self.params:
                free_storage(q)
'''), "model 'mlp': step 0: when unit 0's backward started this rank held 17704 bytes of full parameters, more than "
           "unit 0 needs (6336): the units after it have finished their backward, so free each parameter as soon as "
           "its gradient is reduce-scattered"),
    "r09-2 zero1: a list-form async reduce-scatter, its output read before wait()": ("zero1", subclass("zero1", '''
class Zero1(Base):
    def step(self):
        works = []
        for p in self.params:
            shard = self.shards[p]
            summed = torch.empty_like(shard)
            work = dist.reduce_scatter(summed, list(padded_flat(p.grad, self.world_size).chunk(self.world_size)),
                                       async_op=True)
            shard.grad = summed / self.world_size if shard.grad is None else shard.grad + summed / self.world_size
            works.append(work)
        for work in works:
            work.wait()
        self.optimizer.step()
        for p in self.params:
            self._all_gather(p)
'''), "model 'mlp': after step 0's backward the gradient shard of 0.weight holds NaN: " + HELD + ", so NaN here "
           "means a buffer was read before its wait(): wait() for each reduce-scatter before you read its output."),
    "r09-2 zero1: a list-form async all-gather, copied into the parameter before wait()": (
        "zero1", subclass("zero1", '''
class Zero1(Base):
    def _all_gather(self, p):
        shard = self.shards[p]
        parts = [torch.empty_like(shard) for _ in range(self.world_size)]
        work = dist.all_gather(parts, shard.detach(), async_op=True)
        p.data.copy_(torch.cat(parts)[: p.numel()].view_as(p))
        work.wait()
'''), "model 'mlp': after step 0 the parameters hold NaN, though the shards equal DDP's updated values: " + HELD
           + ", so your class copied a gathered buffer into a parameter before waiting for its all-gather."),
    "zero1: an in-place async all-gather, copied into the parameter before wait()": (
        "zero1", mutated((GATHER_ONE, IN_PLACE), ("view_as(p))  # .data: autograd must not see this copy\n",
                                                  "view_as(p))  # .data: autograd must not see this copy\n"
                                                  "        work.wait()\n")),
        "model 'mlp': after step 0 the parameters hold NaN, though the shards equal DDP's updated values: " + HELD),
}

RIGHT = {
    **{f"the solution, {stage}": (stage, SOLUTION.read_text()) for stage in ("bucketed", "zero1", "zero2", "zero3")},
    "c02 zero1: the list forms, dist.reduce_scatter and dist.all_gather": (
        "zero1", mutated((RS_LINE, "dist.reduce_scatter(summed, list(padded_flat(p.grad, self.world_size)"
                                   ".chunk(self.world_size)))"),
                         ("        dist.all_gather_single(full, self.shards[p].detach())",
                          "        dist.all_gather(list(full.chunk(self.world_size)), self.shards[p].detach())"))),
    "zero1: the list forms with async_op=True, each waited for before its output is read (r09-2)": (
        "zero1", mutated((RS_LINE, "dist.reduce_scatter(summed, list(padded_flat(p.grad, self.world_size)"
                                   ".chunk(self.world_size)), async_op=True).wait()"),
                         ("        dist.all_gather_single(full, self.shards[p].detach())",
                          "        dist.all_gather(list(full.chunk(self.world_size)), self.shards[p].detach(), "
                          "async_op=True).wait()"))),
    "zero1: an in-place all-gather with async_op=True, waited for before the copy": (
        "zero1", mutated((GATHER_ONE, IN_PLACE + "        work.wait()\n"))),
    "zero3: the prefetched unit given its memory when its all-gather is issued (r09-2)": (
        "zero3", mutated((ISSUE, "                alloc_storage(p)  # memory at once, as FSDP2 allocates its output\n"
                                 + ISSUE))),
    "c06 zero1: ReduceOp.AVG instead of a sum divided by N": (
        "zero1", mutated((RS_LINE, RS_LINE.replace("))", "), op=dist.ReduceOp.AVG)")),
                         (AVERAGE, "shard.grad = summed if shard.grad is None else shard.grad + summed"))),
    "c08 bucketed: each bucket divided by N before its all-reduce, as torch's hook does": (
        "bucketed", mutated(("flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]])",
                             "flat = torch.cat([q.grad.reshape(-1) for q in self.buckets[i]]) / self.world_size"),
                            ("(flat / self.world_size)", "flat"))),
    "c09 zero2: the ZeRO paper's buckets (section 5.2), one reduce-scatter and one all-gather per 10 KiB bucket": (
        "zero2", subclass("zero2", GROUPED + '''

class Zero2(Base):
    def __init__(self, params, optimizer_class, **kwargs):
        params = [p for p in params if p.requires_grad]
        super().__init__(params, optimizer_class, **kwargs)
        self.buckets, size = [[]], 0
        for p in reversed(self.params):  # gradients arrive back to front
            if size >= 10 * 1024:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(p)
            size += p.numel() * p.element_size()
        self.bucket_of = {p: i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.ready = [0] * len(self.buckets)

    def _gradient_ready(self, p):  # registered by Zero2's constructor on every parameter
        i = self.bucket_of[p]
        self.ready[i] += 1
        if self.ready[i] < len(self.buckets[i]):
            return
        self.ready[i] = 0
        bucket = self.buckets[i]
        summed = torch.empty(sum(self.shards[q].numel() for q in bucket))
        dist.reduce_scatter_single(summed, _rows([q.grad for q in bucket], self.world_size).reshape(-1))
        for q, part in zip(bucket, summed.split([self.shards[q].numel() for q in bucket])):
            shard = self.shards[q]
            shard.grad = part / self.world_size if shard.grad is None else shard.grad + part / self.world_size
            q.grad = None

    def step(self):
        self.optimizer.step()
        for bucket in self.buckets:
            sizes = [self.shards[q].numel() for q in bucket]
            full = torch.empty(self.world_size * sum(sizes))
            dist.all_gather_single(full, torch.cat([self.shards[q].detach() for q in bucket]))
            for q, part in zip(bucket, full.view(self.world_size, -1).split(sizes, dim=1)):
                q.data.copy_(part.reshape(-1)[: q.numel()].view_as(q))
''')),
    "c11 zero3: one all-gather per unit, FSDP2's grouping": ("zero3", subclass("zero3", GROUPED + '''

class Zero3(Base):
    def _start_gather(self, i):
        if 0 <= i < len(self.units) and i not in self.gathering:
            unit = list(self.units[i].parameters())
            sizes = [self.shards[p].numel() for p in unit]
            full = torch.empty(self.world_size * sum(sizes))
            work = dist.all_gather_single(full, torch.cat([self.shards[p].detach() for p in unit]), async_op=True)
            self.gathering[i] = (unit, sizes, full, work)

    def _gather(self, i, prefetch):
        self._start_gather(i)
        self._start_gather(prefetch)
        unit, sizes, full, work = self.gathering.pop(i)
        work.wait()
        for p, part in zip(unit, full.view(self.world_size, -1).split(sizes, dim=1)):
            alloc_storage(p)
            p.data.copy_(part.reshape(-1)[: p.numel()].view_as(p))
''')),
    "a broadcast in the bucketed constructor, as DDP's (the reader's b_)": (
        "bucketed", mutated(("        self.ready, self.in_flight = [0] * len(self.buckets), []\n\n    def forward",
                             "        self.ready, self.in_flight = [0] * len(self.buckets), []\n"
                             "        for p in module.parameters():\n            dist.broadcast(p.data, src=0)\n\n"
                             "    def forward"))),
    "a broadcast in the zero1 constructor, as DDP's (the reader's g_)": (
        "zero1", mutated(("        self.params = [p for p in params if p.requires_grad]\n",
                          "        self.params = [p for p in params if p.requires_grad]\n"
                          "        for p in self.params:\n            dist.broadcast(p.data, src=0)\n"))),
    "zero3 through dist._all_gather_base, async_op by position (NF-4)": (
        "zero3", mutated(("dist.all_gather_single(full, self.shards[p].detach(), async_op=True)",
                          "dist._all_gather_base(full, self.shards[p].detach(), None, True)"))),
}

CRASHING = {  # each crashes its launch, so each runs alone
    "W4 zero1: the all-gather's output unpadded, p.numel() values (09-2)": (
        "zero1", mutated(("        full = torch.empty(self.world_size * self.shards[p].numel(), dtype=p.dtype, "
                          "device=p.device)\n        dist.all_gather_single(full, self.shards[p].detach())\n",
                          "        full = torch.empty(p.numel(), dtype=p.dtype, device=p.device)\n"
                          "        dist.all_gather_single(full, self.shards[p].detach())\n")),
        "(in _all_gather): RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (18), "
        "got (17)). What it means: gloo checks that a reduce-scatter's input holds exactly world_size times its "
        "output's values (an all-gather's output world_size times its input's); a parameter whose size does not divide "
        "by the world size must be padded with zeros first (padded_flat)"),
    "zero3: gathers and copies at once, prefetch included, so the tied weight is freed (the reader's W3 on tied)": (
        "zero3", subclass("zero3", '''
class Zero3(Base):
    def _start_gather(self, i):  # gathers and copies at once; a unit already gathered is skipped
        if 0 <= i < len(self.units) and i not in self.gathering:
            self.gathering[i] = []
            for p in self.units[i].parameters():
                full = torch.empty(self.world_size * self.shards[p].numel())
                dist.all_gather_single(full, self.shards[p].detach())
                alloc_storage(p)
                p.data.copy_(full[: p.numel()].view_as(p))

    def _gather(self, i, prefetch):
        self._start_gather(i)
        self._start_gather(prefetch)
        self.gathering.pop(i)
'''), ": the check stopped your class: model 'tied', step 0: unit 1's forward was about to run "
          "with a.weight freed (0 bytes of storage) (a.weight is also unit 0's: one tied weight, so freeing unit 0 "
          "freed it): when your class's forward pre-hook for unit 1 returned, that parameter had no memory"),
    "m05a zero1: shards by torch.chunk, no padding (35 values: 18 and 17)": (
        "zero1", mutated(("padded_flat(p, self.world_size).chunk(self.world_size)[self.rank].clone()",
                          "p.detach().reshape(-1).chunk(self.world_size)[self.rank].clone()"),
                         (RS_LINE, "dist.reduce_scatter_single(summed, p.grad.reshape(-1))")),
        "What it means: gloo checks that a reduce-scatter's input holds exactly world_size times its output's values"),
    "zero2: step() left to Zero1's, which reads the freed full gradients (the walkthrough's nostep)": (
        "zero2", subclass("zero2", '''
class Zero2(Base):
    step = Base.__mro__[1].step  # Zero1's step: reduce-scatters p.grad, which the hook has freed
'''), "AttributeError: 'NoneType' object has no attribute 'detach'"),
    "zero3: copies into a freed parameter without alloc_storage (the walkthrough's noalloc: a segfault)": (
        "zero3", mutated(("            alloc_storage(p)\n            p.data.copy_(full[: p.numel()].view_as(p))",
                          "            p.data.copy_(full[: p.numel()].view_as(p))")),
        "(exit code -11: killed by a signal, so no Python traceback): Fatal Python error: Segmentation fault. What it "
        "means: the process touched memory it does not own; in this lesson that is usually a copy into a parameter "
        "whose storage free_storage emptied: call alloc_storage(p) before copying in."),
}
