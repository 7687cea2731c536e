"""Lesson 12: the ring-attention and expert-parallel checks accept the solutions and right-but-different designs,
say "Not yet" on the starting code, and name each wrong class's mistake. Wrong classes are mutated copies of
helpers/workers/context_ring_solution.py and experts_moe_solution.py, among them the wrong implementations a fresh
reader wrote (W2 to W5; W1, a merge, is in tests/fast/test_context_experts_kit.py); several share one launch
(helpers.lessons.context_experts.grade_many) to keep the suite fast; a crash on one rank alone and a hang get a launch
each."""
import json
import re
from pathlib import Path

import pytest

from helpers.lessons.context_experts import check_merge, check_moe, check_ring, grade_many

ROOT = Path(__file__).resolve().parent.parent
RING = ROOT / "helpers" / "workers" / "context_ring_solution.py"
MOE = ROOT / "helpers" / "workers" / "experts_moe_solution.py"
NOTEBOOK = ROOT / "notebooks" / "12_context_and_experts.ipynb"


def mutated(source: Path, folder: Path, name: str, replacements: list[tuple[str, str]]) -> Path:
    text = source.read_text()
    for old, new in replacements:
        assert text.count(old) >= 1, f"the solution no longer contains {old!r}"
        text = text.replace(old, new)
    path = folder / f"{name}.py"
    path.write_text(text)
    return path


FORWARD_LOOP = "        for step in range(world_size):\n            if step < world_size - 1:\n                incoming"
LAST_PASS = ("            incoming, requests = pass_on(travelling if step < world_size - 1 else "
             "travelling[2:].contiguous())\n            for request in requests:\n                request.wait()\n"
             "            travelling = incoming\n        return grad_q, travelling[-2], travelling[-1], None, None")

# Not causal, 4 ranks (on 2 ranks the previous and the next rank are the same rank): name -> (edits, message)
RING_MUTANTS = {
    "stops the ring one step early": (
        [(FORWARD_LOOP, FORWARD_LOOP.replace("range(world_size)", "range(world_size - 1)"))],
        "the output equals attention over the blocks of the first 3 steps of the ring"),
    "never passes dk, dv home after the last step": (
        [(LAST_PASS, "            if step < world_size - 1:\n                incoming, requests = pass_on(travelling)\n"
                     "                for request in requests:\n                    request.wait()\n"
                     "                travelling = incoming\n"
                     "        return grad_q, travelling[-2], travelling[-1], None, None")],
        "dk equals the gradient of rank 1's keys and values"),
    "starts from out = 0, lse = -inf with torch's sigmoid merge (a fresh reader's W5)": (
        [("    new_lse = torch.logaddexp(lse, block_lse)  # log(exp(lse) + exp(block_lse)), without overflow\n"
          "    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + "
          "torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out\n"
          "    return out, new_lse",
          "    import torch.nn.functional as F\n"
          "    out = out - F.sigmoid(block_lse - lse).unsqueeze(-1) * (out - block_out)\n"
          "    return out, lse - F.logsigmoid(lse - block_lse)"),
         ("        outs, lses = [None] * len(mine), [None] * len(mine)",
          "        outs = [torch.zeros_like(c) for c in queries]\n"
          "        lses = [torch.full(c.shape[:-1], float('-inf')) for c in queries]"),
         ("                if outs[i] is None:\n                    outs[i], lses[i] = block_out, block_lse\n"
          "                else:\n                    outs[i], lses[i] = merge(outs[i], lses[i], block_out, block_lse)",
          "                outs[i], lses[i] = merge(outs[i], lses[i], block_out, block_lse)")],
        "the output holds nan, and your merge gives nan in one case: merging a block into an empty start"),
    "keeps dk, dv of its own block at home (they never travel)": (
        [("        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # k, v, dk, dv",
          "        travelling = torch.stack([k, v, torch.zeros_like(k), torch.zeros_like(v)])  # k, v, dk, dv\n"
          "        home = torch.zeros_like(travelling[2:])"),
         ("                grad_k[j].add_(dk)  # views into `travelling`: the gradients ride along with their block\n"
          "                grad_v[j].add_(dv)",
          "                if step == 0:\n                    home[0].chunk(len(theirs), dim=2)[j].add_(dk)\n"
          "                    home[1].chunk(len(theirs), dim=2)[j].add_(dv)"),
         ("        return grad_q, travelling[-2], travelling[-1], None, None",
          "        return grad_q, home[0], home[1], None, None")],
        "dk holds only this rank's own queries' share"),
}

CAUSAL_MUTANTS = {
    "no causal mask on the diagonal block": (
        [("            elif b == a:\n                yield i, j, True",
          "            elif b == a:\n                yield i, j, False")],
        "the output equals a ring that does not mask the diagonal block"),
    "uses the blocks above the diagonal, unmasked": (
        [("            elif b == a:\n                yield i, j, True\n",
          "            elif b == a:\n                yield i, j, True\n"
          "            else:\n                yield i, j, False\n")],
        "the output equals a ring that also uses the blocks above the diagonal"),
    "sends to rank - 1, receives from rank + 1": (
        [("[dist.isend(tensor, (rank + 1) % world_size), dist.irecv(received, (rank - 1) % world_size)]",
          "[dist.isend(tensor, (rank - 1) % world_size), dist.irecv(received, (rank + 1) % world_size)]")],
        "the output equals a ring that takes the block it holds at step s for another rank's"),
    "takes the block at step s for rank (rank + s)'s": (
        [("            theirs = layout[(rank - step) % world_size]\n            keys, values = kv",
          "            theirs = layout[(rank + step) % world_size]\n            keys, values = kv")],
        "the output equals a ring that takes the block it holds at step s for another rank's"),
    "computes the blocks above the diagonal and throws them away": (
        [("            for i, j, diagonal in needed(mine, theirs, causal):\n"
          "                block_out, block_lse = block_attention(queries[i], keys[j], values[j], diagonal)\n",
          "            for i, j, diagonal in needed(mine, theirs, False):\n"
          "                block_out, block_lse = block_attention(queries[i], keys[j], values[j],\n"
          "                                                       causal and mine[i] == theirs[j])\n"
          "                if causal and theirs[j] > mine[i]:\n"
          "                    block_lse = torch.full_like(block_lse, float('-inf'))\n")],
        "the result is right, but the forward computed"),
    "reads the block's chunks one step behind (a fresh reader's W2)": (
        [("            theirs = layout[(rank - step) % world_size]\n            keys, values = kv",
          "            theirs = layout[(rank - step - 1) % world_size]\n            keys, values = kv"),
         ("            theirs = ctx.layout[(rank - step) % world_size]",
          "            theirs = ctx.layout[(rank - step - 1) % world_size]")],
        "the output equals a ring that reads the chunk numbers of the block it holds at step s from the previous or "
        "the next step's rank"),
    "decides by rank, not by chunk (a walkthrough's learner)": (  # right on the contiguous layout only
        [("            if not causal or b < a:\n                yield i, j, False\n            elif b == a:\n"
          "                yield i, j, True",
          "            if not causal or theirs[0] < mine[0]:  # rank r's first chunk is r: the ranks compared\n"
          "                yield i, j, False\n            elif theirs[0] == mine[0]:\n"
          "                yield i, j, i == j")],
        "The contiguous layout passed, so a rule on ranks and steps can hold there"),
    "ignores causal: exercise 2's ring unchanged (a walkthrough's learner)": (
        [("def needed(mine, theirs, causal):\n", "def needed(mine, theirs, causal):\n    causal = False\n")],
        "the output equals attention without any mask: causal=True is ignored"),
    "masks the blocks above the diagonal with the triangle (a walkthrough's learner)": (
        [("            elif b == a:\n                yield i, j, True",
          "            else:\n                yield i, j, True")],
        "the output equals a ring that computes the blocks above the diagonal with the triangular mask"),
    "a backward without the causal rule (a walkthrough's learner)": (
        [("            for i, j, diagonal in needed(mine, theirs, ctx.causal):",
          "            for i, j, diagonal in needed(mine, theirs, False):")],
        "With causal=True the backward must follow the forward's rule"),
    "sums the blocks' outputs instead of merging": (  # a merge that passes exercise 1 is not called: sums inline
        [("                    outs[i], lses[i] = merge(outs[i], lses[i], block_out, block_lse)",
          "                    outs[i], lses[i] = outs[i] + block_out, torch.logaddexp(lses[i], block_lse)")],
        "the output equals the sum of the blocks' outputs"),
}

ALL_GATHER = '''

class AllGatherAttention(torch.autograd.Function):
    """Right but different: every rank all-gathers k and v (whole sequence held at once), and reduce-scatters dk, dv."""

    @staticmethod
    def forward(ctx, q, k, v, layout, causal):
        rank, world_size = dist.get_rank(), dist.get_world_size()
        gathered = torch.empty((world_size * 2, *k.shape))
        dist.all_gather_into_tensor(gathered, torch.stack([k, v]).contiguous())
        gathered = gathered.view(world_size, 2, *k.shape)
        mine, outs, lses = layout[rank], {}, {}
        queries = q.chunk(len(mine), dim=2)
        for source in range(world_size):
            theirs = layout[source]
            keys, values = gathered[source, 0].chunk(len(theirs), dim=2), gathered[source, 1].chunk(len(theirs), dim=2)
            for i, j, diagonal in needed(mine, theirs, causal):
                block = block_attention(queries[i], keys[j], values[j], diagonal)
                outs[i], lses[i] = block if i not in outs else merge(outs[i], lses[i], *block)
        out = torch.cat([outs[i] for i in range(len(mine))], dim=2)
        lse = torch.cat([lses[i] for i in range(len(mine))], dim=2)
        ctx.save_for_backward(q, out, lse, gathered)
        ctx.layout, ctx.causal = layout, causal
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, out, lse, gathered = ctx.saved_tensors
        rank, world_size = dist.get_rank(), dist.get_world_size()
        mine = ctx.layout[rank]
        n = len(mine)
        queries, outs, lses, grads = (t.chunk(n, dim=2) for t in (q, out, lse, grad_out.contiguous()))
        grad_q, grad_kv = torch.zeros_like(q), torch.zeros(gathered.shape)
        for source in range(world_size):
            theirs = ctx.layout[source]
            keys, values = gathered[source, 0].chunk(len(theirs), dim=2), gathered[source, 1].chunk(len(theirs), dim=2)
            for i, j, diagonal in needed(mine, theirs, ctx.causal):
                dq, dk, dv = block_attention_backward(queries[i], keys[j], values[j], outs[i], lses[i], grads[i],
                                                      diagonal)
                grad_q.chunk(n, dim=2)[i].add_(dq)
                grad_kv[source, 0].chunk(len(theirs), dim=2)[j].add_(dk)
                grad_kv[source, 1].chunk(len(theirs), dim=2)[j].add_(dv)
        mine_kv = torch.empty(gathered.shape[1:])
        dist.reduce_scatter_tensor(mine_kv, grad_kv.view(-1, *gathered.shape[2:]))
        return grad_q, mine_kv[0], mine_kv[1], None, None


def ring_attention(q, k, v, layout, causal=False):
    return AllGatherAttention.apply(q, k, v, layout, causal)
'''

SIGMOID_MERGE = [(  # torch's own form of the same rule (_attention.py, _SDPAMerger._merge_one)
    "    new_lse = torch.logaddexp(lse, block_lse)  # log(exp(lse) + exp(block_lse)), without overflow\n"
    "    out = torch.exp(lse - new_lse).unsqueeze(-1) * out + "
    "torch.exp(block_lse - new_lse).unsqueeze(-1) * block_out\n"
    "    return out, new_lse",
    "    import torch.nn.functional as F\n"
    "    out = out - F.sigmoid(block_lse - lse).unsqueeze(-1) * (out - block_out)\n"
    "    return out, lse - F.logsigmoid(lse - block_lse)")]


BATCHED = [(  # picotron's form: one batch_isend_irecv of two P2POps (the check's held receives must accept it)
    "    requests = [dist.isend(tensor, (rank + 1) % world_size), dist.irecv(received, (rank - 1) % world_size)]",
    "    requests = dist.batch_isend_irecv([dist.P2POp(dist.isend, tensor, (rank + 1) % world_size),\n"
    "                                       dist.P2POp(dist.irecv, received, (rank - 1) % world_size)])")]


def _ring_files(folder: Path, mutants: dict) -> dict[str, Path]:
    files = {name: mutated(RING, folder, f"m{i}", edits) for i, (name, (edits, _)) in enumerate(mutants.items())}
    files["right: batch_isend_irecv of P2POps"] = mutated(RING, folder, "batched", BATCHED)
    files["right: all-gather instead of a ring"] = folder / "all_gather.py"
    files["right: all-gather instead of a ring"].write_text(RING.read_text() + ALL_GATHER)
    files["right: torch's sigmoid form of the merge"] = mutated(RING, folder, "sigmoid", SIGMOID_MERGE)
    return files


@pytest.mark.parametrize("causal", [False, True], ids=["not causal", "causal"])
def test_ring_check_names_each_mistake_and_passes_other_right_designs(causal, tmp_path):
    mutants = CAUSAL_MUTANTS if causal else RING_MUTANTS
    files = _ring_files(tmp_path, mutants)
    verdicts = grade_many("ring", list(files.values()), nproc=4, causal=causal)
    for name, path in files.items():
        verdict = verdicts[str(path.resolve())]
        if name.startswith("right: "):
            assert verdict is None, (name, verdict)
        else:
            assert verdict is not None and mutants[name][1] in verdict, (name, verdict)
        if name.startswith("ignores causal"):  # exercise 3's untouched code: the mistake named, the rule not given
            assert "diagonal" not in verdict and "skip" not in verdict.lower(), verdict


MOE_MUTANTS = {
    "sends expert e's tokens to rank e % N": (
        [("        order = torch.argsort(expert, stable=True)  # by expert, so by the rank that owns it\n",
          "        local_count = self.num_experts // self.world_size\n"
          "        expert = (expert % self.world_size) * local_count + expert // self.world_size\n"
          "        order = torch.argsort(expert, stable=True)  # by expert, so by the rank that owns it\n")],
        "the output equals a layer whose rank sends expert e's tokens to rank e % N"),
    "adds the experts' outputs without the router's weights": (
        [("index_add(0, token, weights[token, slot].unsqueeze(-1) * back)", "index_add(0, token, back)")],
        "without the router's weights"),
    "applies no capacity": (
        [("            self.kept = capacity_keep(chosen, self.num_experts, limit)",
          "            self.kept = torch.ones_like(chosen, dtype=torch.bool)")],
        "the reference keeps"),
    "second choices before first choices": (
        [("            self.kept = capacity_keep(chosen, self.num_experts, limit)",
          "            self.kept = capacity_keep(chosen.flip(1), self.num_experts, limit).flip(1)")],
        "every token's first choice before any second choice"),
    "the way back with the dispatch's splits, not swapped (a fresh reader's W3)": (
        [("        back = all_to_all_single_autograd(results, send_rows, receive_rows, dist.group.WORLD)",
          "        back = all_to_all_single_autograd(results, receive_rows, send_rows, dist.group.WORLD)")],
        "the return trip takes the dispatch's splits swapped"),
    "the router's weight on the rows and on the results (a fresh reader's W4)": (
        [("        arrived = all_to_all_single_autograd(x[token], receive_rows, send_rows, dist.group.WORLD)",
          "        gated = weights[token, slot].unsqueeze(-1) * x[token]\n"
          "        arrived = all_to_all_single_autograd(gated, receive_rows, send_rows, dist.group.WORLD)")],
        "applies the router's weight twice"),
    "the router's weight on the rows only": (
        [("        arrived = all_to_all_single_autograd(x[token], receive_rows, send_rows, dist.group.WORLD)",
          "        gated = weights[token, slot].unsqueeze(-1) * x[token]\n"
          "        arrived = all_to_all_single_autograd(gated, receive_rows, send_rows, dist.group.WORLD)"),
         ("index_add(0, token, weights[token, slot].unsqueeze(-1) * back)", "index_add(0, token, back)")],
        "weights the rows before the experts"),
    "a plain all-to-all without autograd for the tokens": (
        [("        arrived = all_to_all_single_autograd(x[token], receive_rows, send_rows, dist.group.WORLD)",
          "        arrived = x.new_empty(sum(receive_rows), x.shape[1])\n"
          "        dist.all_to_all_single(arrived, x[token].detach(), receive_rows, send_rows)")],
        "a plain dist.all_to_all_single has no backward"),
}

EXPERT_IDS = [(  # right but different: the expert numbers travel beside the rows instead of per-expert counts
    "        which = torch.arange(local).repeat(self.world_size).repeat_interleave(receiving)",
    "        ids = x.new_empty(sum(receive_rows), dtype=torch.long)\n"
    "        dist.all_to_all_single(ids, expert, receive_rows, send_rows)\n"
    "        which = ids - self.rank * local")]


def test_moe_check_names_each_mistake_and_passes_another_right_design(tmp_path):
    files = {name: mutated(MOE, tmp_path, f"m{i}", edits) for i, (name, (edits, _)) in enumerate(MOE_MUTANTS.items())}
    files["right: expert numbers sent beside the rows"] = mutated(MOE, tmp_path, "ids", EXPERT_IDS)
    verdicts = grade_many("moe", list(files.values()), nproc=2)
    for name, path in files.items():
        verdict = verdicts[str(path.resolve())]
        if name.startswith("right: "):
            assert verdict is None, (name, verdict)
        else:
            assert verdict is not None and MOE_MUTANTS[name][1] in verdict, (name, verdict)


def test_checks_accept_the_solutions_on_two_and_four_ranks(capsys):
    assert check_ring(RING, causal=True)
    assert check_moe(MOE)
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("Checking", "Starting"))]
    assert len(lines) == 2 and all(line.startswith("Correct: ") for line in lines), lines
    assert "Your design: a ring: k and v passed on with send/receive" in lines[0], lines[0]  # names what it saw


def test_a_forgotten_count_exchange_crashes_with_gloos_size_check_explained(tmp_path, capsys):
    path = mutated(MOE, tmp_path, "no_counts", [
        ("        dist.all_to_all_single(receiving, sending)  # equal splits: `local` counts to every rank\n",
         "        receiving = sending.clone()  # assumes every rank receives what it sends\n")])
    assert not check_moe(path, sizes=(2,))
    out = capsys.readouterr().out.splitlines()[-1]
    assert out.startswith("Not yet: the expert-parallel check of no_counts.py on 2 ranks crashed on rank"), out
    assert "no_counts.py:" in out and "exchange the counts first" in out, out  # the learner's own line, the advice


def test_a_ring_that_waits_before_it_sends_is_stopped_and_says_where(tmp_path, capsys):
    path = mutated(RING, tmp_path, "recv_first", [
        ("    requests = [dist.isend(tensor, (rank + 1) % world_size), dist.irecv(received, (rank - 1) % world_size)]",
         "    dist.recv(received, (rank - 1) % world_size)  # waits for a send no rank has started\n"
         "    requests = [dist.isend(tensor, (rank + 1) % world_size)]")])
    assert not check_ring(path, sizes=(2,), timeout=12)
    out = capsys.readouterr().out
    assert "Checking on 2 ranks (a run that hangs is stopped after 12 s)..." in out, out  # said before the wait
    assert "did not finish within 12 s; where each rank was waiting:" in out and "recv_first.py:" in out, out
    assert "wait() both requests of a step before using `incoming`" in out, out  # a ring's hang names the waits
    assert "A blocking dist.recv returns only once its peer has sent" in out, out  # and what a blocking receive does


def test_a_forward_that_never_waits_for_its_receives_is_named_on_two_ranks(tmp_path, capsys):
    """A walkthrough's learner: without the wait() the forward passed on 2 ranks (gloo had delivered the block
    already) and hung on 4. The check's held receives (NaN until wait()) make it fail on 2 ranks, every run, with
    one of two messages that both name the missing wait: the count of receives never waited for, or (when a rank's
    backward then waits on a receive its peer never matches, seen in about one run in two today) the hang's hint."""
    path = mutated(RING, tmp_path, "no_wait", [
        ("            if step < world_size - 1:\n                for request in requests:\n"
         "                    request.wait()\n                kv = incoming\n",
         "            if step < world_size - 1:\n                kv = incoming  # never waited for\n")])
    assert not check_ring(path, sizes=(2,), timeout=20)  # a right ring finishes in seconds; the hang costs 20 s, not 60
    out = capsys.readouterr().out.splitlines()[-1]
    if "never called wait() on them" in out:
        assert "the forward started 1 receive(s) with dist.irecv and never called wait() on them" in out, out
        assert "wait() both requests before using `incoming`" in out, out
    else:  # the hang: where the rank waited, and the same advice
        assert "in request.wait at no_wait.py:" in out, out
        assert "wait() both requests of a step before using `incoming`" in out, out


def test_starting_code_in_the_notebook_says_not_yet(tmp_path, capsys):
    cells = ["".join(c["source"]) for c in json.loads(NOTEBOOK.read_text())["cells"] if c["cell_type"] == "code"]
    files = {}
    for source in cells:
        match = re.match(r"%%writefile (\S+)\n", source)
        if match:
            files[match[1]] = tmp_path / match[1]
            files[match[1]].write_text(source[match.end():])
    assert set(files) == {"my_ring_attention.py", "my_moe.py"}
    assert not check_merge(files["my_ring_attention.py"])
    assert not check_ring(files["my_ring_attention.py"], sizes=(2,))
    assert not check_moe(files["my_moe.py"], sizes=(2,))
    out = [line for line in capsys.readouterr().out.splitlines() if not line.startswith(("Checking", "Starting"))]
    assert len(out) == 3 and all(line.startswith("Not yet: ") for line in out), out
