"""Lesson 12 (context and expert parallelism): the exercise checks, and the tables and pictures of the lesson.

    from helpers.lessons.context_experts import check_merge, check_ring, check_moe
    check_merge("my_ring_attention.py")               # in this process: prints "Correct: ..." or "Not yet: ..."
    checked = check_ring("my_ring_attention.py", causal=True, keep=runs)   # launches context_check.py on 2, 4 ranks
    checked = check_moe("my_moe.py", keep=runs)                            # launches experts_check.py on 2, 4 ranks

Every number a check compares with comes from the same run: one-process attention (F.scaled_dot_product_attention)
and torch's own ring attention for context parallelism, the same mixture of experts in one process for expert
parallelism (helpers/kit/context_experts.py). The workers are helpers/workers/context_*.py and experts_*.py.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import torch

from helpers import LaunchTimeout, WorkerFailed, launch
from helpers.kit import WORKERS
from helpers.kit.context_experts import block_attention, layout
from helpers.lessons.checks import correct, each_rank, not_yet, not_yet_crashed

TRUTH, TORCH = 1e-5, 1e-6  # fp32: against one-process attention (the bar), against torch's own ring
SIZES = (2, 4)


class Checked:
    """What a launching check hands back: true when it passed; `.results[world_size]` holds every rank's results."""

    def __init__(self, passed: bool, results: dict[int, dict] | None = None) -> None:
        self.passed, self.results = passed, results or {}

    def __bool__(self) -> bool:
        return self.passed


def _launch(worker: str, nproc: int, args: list[str], timeout: float, what: str) -> tuple[Any, str | None]:
    """One launch: (run, None), or (None, the sentence a learner reads) when it crashed or hung."""
    try:
        return launch(WORKERS / worker, nproc=nproc, echo=False, timeout=timeout, args=args), None
    except LaunchTimeout as error:
        return None, (f"{what} on {nproc} ranks did not finish within {timeout:g} s; where each rank was waiting:"
                      f"{each_rank(error.where)}. A rank that waits in a receive or a collective its peer never "
                      f"joins: check which rank each send goes to and which each receive expects.")
    except WorkerFailed as error:
        from helpers.lessons.checks import explain_crash
        return None, explain_crash(error, f"{what} on {nproc} ranks")


# --------------------------------------------------------------------------------------------- exercise 1


def load_module(path: str | Path) -> Any:
    """Import a learner's file afresh (edits since the last import are seen)."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}_{path.stat().st_mtime_ns}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _merge_cases() -> list[tuple[str, tuple, tuple]]:
    """(what, the two blocks' (out, lse, out, lse), the truth (out, lse)) for the merge check."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for what, scale in (("ordinary scores", 1.0), ("large scores (log-sum-exp up to 276)", 80.0)):
        q = torch.randn(1, 2, 5, 8, generator=generator) * scale
        k, v = torch.randn(1, 2, 12, 8, generator=generator), torch.randn(1, 2, 12, 8, generator=generator)
        first = block_attention(q, k[..., :7, :], v[..., :7, :])
        second = block_attention(q, k[..., 7:, :], v[..., 7:, :])
        cases.append((what, (*first, *second), block_attention(q, k, v)))
    return cases


def merge_problem(merge: Any) -> str | None:
    """The first thing wrong with a learner's merge(out, lse, block_out, block_lse), or None."""
    for what, blocks, (want_out, want_lse) in _merge_cases():
        try:
            got = merge(*blocks)
        except Exception as error:  # the learner's own code: any error is theirs to see
            return f"merge raised {type(error).__name__}: {error}"
        if not (isinstance(got, tuple) and len(got) == 2 and all(isinstance(t, torch.Tensor) for t in got)):
            return f"merge should return two tensors (out, lse), it returned {type(got).__name__}"
        out, lse = got
        if out.shape != want_out.shape or lse.shape != want_lse.shape:
            return (f"merge returned out of shape {list(out.shape)} and lse of shape {list(lse.shape)}; both blocks'"
                    f" shapes are {list(want_out.shape)} and {list(want_lse.shape)}")
        if not (torch.isfinite(out).all() and torch.isfinite(lse).all()):
            return (f"with {what} merge returned inf or nan: exp(lse) overflows float32 above lse = 88 (its largest "
                    "value is 3.4e38); subtract the larger lse before exp, or use torch.logaddexp")
        out_1, lse_1, out_2, lse_2 = blocks
        if (out - want_out).abs().max() > TRUTH:
            hint = _merge_hint(out, (out_1, lse_1, out_2, lse_2))
            return f"with {what} the merged output differs from attention over both blocks" + hint
        if ((lse - want_lse).abs() / want_lse.abs().clamp_min(1)).max() > TRUTH:  # relative: float32 near 276
            if torch.allclose(lse, torch.maximum(lse_1, lse_2)):
                return ("the merged output is right but the new lse is the larger of the two: it must be "
                        "log(exp(lse) + exp(block_lse)), what the next block's merge weighs against")
            if torch.allclose(lse, lse_1) or torch.allclose(lse, lse_2):
                return ("the merged output is right but merge returned one block's lse unchanged: the new lse is "
                        "log(exp(lse) + exp(block_lse)), what the next block's merge weighs against")
            return "the merged output is right but the new lse is not log(exp(lse) + exp(block_lse))"
    return None


def _merge_hint(out: torch.Tensor, blocks: tuple) -> str:
    out_1, lse_1, out_2, lse_2 = blocks
    if torch.allclose(out, out_2) or torch.allclose(out, out_1):
        return ": it equals one block's output (the other block was dropped)."
    if torch.allclose(out, (out_1 + out_2) / 2, atol=TRUTH):
        return (": it is the plain average of the two outputs; weigh each by its share of the softmax's "
                "denominator, exp(lse_i - new_lse).")
    if torch.allclose(out, out_1 + out_2, atol=TRUTH):
        return ": it is the sum of the two outputs; weigh each by exp(lse_i - new_lse), which add up to 1."
    largest = torch.maximum(lse_1, lse_2).unsqueeze(-1)
    unnormalised = torch.exp(lse_1.unsqueeze(-1) - largest) * out_1 + torch.exp(lse_2.unsqueeze(-1) - largest) * out_2
    if torch.allclose(out, unnormalised, atol=TRUTH):
        return (": the weights exp(lse_i - max) do not add up to 1; divide by their sum (equivalently, use "
                "exp(lse_i - new_lse)).")
    return f" by up to {float((out - _truth_of(blocks)).abs().max()):.2g}."


def _truth_of(blocks: tuple) -> torch.Tensor:
    out_1, lse_1, out_2, lse_2 = blocks
    new = torch.logaddexp(lse_1, lse_2).unsqueeze(-1)
    return torch.exp(lse_1.unsqueeze(-1) - new) * out_1 + torch.exp(lse_2.unsqueeze(-1) - new) * out_2


def check_merge(path: str | Path) -> bool:
    """Exercise 1: `merge` in the learner's file, in this process (no launch)."""
    try:
        merge = load_module(path).merge
    except Exception as error:
        return not_yet(f"importing merge from {Path(path).name} failed: {type(error).__name__}: {error}")
    problem = merge_problem(merge)
    if problem:
        return not_yet(problem)
    worst = max(float((merge(*blocks)[0] - want[0]).abs().max()) for _, blocks, want in _merge_cases())
    return correct(f"merge gives attention over both blocks, output and log-sum-exp, for ordinary scores and for "
                   f"scores whose log-sum-exp reaches 276 (largest difference {worst:.1g} < {TRUTH:g}).")


# --------------------------------------------------------------------------------------------- exercises 2 and 3

MISTAKE_ADVICE = {
    "no diagonal mask": ("a ring that does not mask the diagonal block: where a query chunk meets its own keys, query "
                         "i of the block may see keys 0..i only (block_attention(..., diagonal=True))"),
    "blocks above the diagonal computed": ("a ring that also uses the blocks above the diagonal (key chunks that "
                                           "come after the query chunk): no query may see those keys, skip them"),
    "sent the other way round": ("a ring that takes the block it holds at step s for another rank's: sending to "
                                 "rank + 1 and receiving from rank - 1, the block at step s is rank (rank - s) mod "
                                 "N's, whose chunks are layout[(rank - s) % N] (a ring that sends to rank - 1 but "
                                 "labels the blocks that way gives this same output, as does one that labels them "
                                 "(rank + s))"),
    "sum of blocks, not merged": "the sum of the blocks' outputs: merge them by the log-sum-exp rule (exercise 1)",
}


def _where(rank: int, kind: str, world_size: int) -> str:
    return f"{world_size} ranks, {kind} layout {layout(kind, world_size)}, rank {rank}"


def ring_problem(per_rank: dict[int, dict], causal: bool) -> str | None:
    """The first thing wrong in one launch's results of one file, as the sentence after "Not yet: ", or None."""
    first = per_rank[min(per_rank)]
    if "error" in first:
        return f"the check ran into {first['error']}"
    for kind in first:
        for find in (lambda got: _output_problem(got, causal), _gradient_problem,  # outputs on every rank first
                     lambda got: _work_problem(got, causal)):
            for rank, graded in sorted(per_rank.items()):
                problem = find(graded[kind])
                if problem:
                    return f"{_where(rank, kind, len(graded[kind]['layout']))}: {problem}"
    return None


def _output_problem(got: dict, causal: bool) -> str | None:
    world_size = len(got["layout"])
    want_shape = [1, 2, len(got["rows"]), 8]
    if got["shape"] != want_shape:
        return (f"ring_attention returned {got['shape']}; it should return this rank's output, the shape of its "
                f"q, {want_shape}.")
    if got["backward_error"]:
        return ("the output does not require grad, so no backward can run: return RingAttention.apply(q, k, v, "
                "layout, causal) from ring_attention.")
    error = got["vs_truth"]["out"]
    if error <= TRUTH:
        return None
    if math.isnan(error):
        return ("the output holds nan: a block whose every score is masked leaves softmax nothing to divide by. "
                "Skip blocks whose keys all come after the queries instead of masking them.")
    matches = got["matches"]
    if matches["steps"]:
        seen = "its own chunks only" if matches["steps"] == 1 else f"the blocks of the first {matches['steps']} steps"
        return (f"the output equals attention over {seen} of the ring; the ring has {world_size} steps, and every "
                "query must see the keys of every rank (that come before it, with a causal mask).")
    for mistake in MISTAKE_ADVICE:
        if mistake in matches["mistakes"]:
            return f"the output equals {MISTAKE_ADVICE[mistake]}."
    return (f"the output differs from one-process attention over the whole sequence by up to {error:.2g} (more "
            f"than {TRUTH:g}).")


def _gradient_problem(got: dict) -> str | None:
    for name in ("q", "k", "v"):
        error = got["vs_truth"][name]
        if error <= TRUTH:
            continue
        matches = got["matches"]
        if name in "kv" and matches["k_owner"] is not None:
            return (f"d{name} equals the gradient of rank {matches['k_owner']}'s keys and values: the gradients of a "
                    "block travel with it and must end at the rank that owns the block (after the last step, pass "
                    "them on once more).")
        if name in "kv" and matches["own_share_only"]:
            return (f"d{name} holds only this rank's own queries' share: dk and dv must travel around the ring with "
                    "their block, each rank adding its queries' share, and come home.")
        return (f"the output is right but d{name} differs from one-process attention's gradient by up to "
                f"{error:.2g} (more than {TRUTH:g}).")
    for name, error in got["vs_torch"].items():
        if error > TORCH:
            return (f"every tensor is within {TRUTH:g} of one-process attention, but {name if name == 'out' else 'd' + name}"
                    f" differs from torch's own ring attention by {error:.2g} (more than {TORCH:g}).")
    return None


def _work_problem(got: dict, causal: bool) -> str | None:
    need = got["expected"]["blocks"] * got["block_flops"]
    done = got["forward"]["flops"]
    if done <= need:
        return None
    extra = (done - need) / got["block_flops"]
    if causal:
        return (f"the result is right, but the forward computed {done} FLOPs where the {got['expected']['blocks']} "
                f"blocks it needs take {need} ({extra:g} block(s) more): a block whose keys all come after its "
                "queries needs no work; skip it rather than mask it.")
    return (f"the result is right, but the forward computed {done} FLOPs where this rank's queries over every key take "
            f"{need}: compute this rank's queries only.")


def check_ring(path: str | Path, causal: bool = False, keep: dict | None = None, timeout: float = 60,
               sizes: tuple[int, ...] = SIZES) -> Checked:
    """Exercises 2 (causal=False) and 3 (causal=True): the learner's ring_attention on 2 and then 4 ranks.
    keep: a dict that receives the check under "ring" or "causal" when it passes."""
    problem = _merge_first(path)
    if problem:
        return Checked(not_yet(problem))
    results = {}
    what = f"the {'causal ' if causal else ''}ring attention check of {Path(path).name}"
    for nproc in sizes:
        print(f"Checking on {nproc} ranks...", flush=True)
        run, failed = _launch("context_check.py", nproc, ["--impl", str(Path(path).resolve())]
                              + (["--causal"] if causal else []), timeout, what)
        if failed:
            return Checked(not_yet(failed))
        per_rank = {rank: got["graded"][str(Path(path).resolve())] for rank, got in run.results.items()}
        problem = ring_problem(per_rank, causal)
        if problem:
            return Checked(not_yet(problem), results)
        results[nproc] = per_rank
    truth = max(g["vs_truth"][n] for r in results.values() for g_kind in r.values() for g in g_kind.values()
                for n in ("out", "q", "k", "v"))
    theirs = max(g["vs_torch"][n] for r in results.values() for g_kind in r.values() for g in g_kind.values()
                 for n in ("out", "q", "k", "v"))
    checked = Checked(correct(
        f"on {' and '.join(map(str, sizes))} ranks, contiguous and balanced layouts{', causal' if causal else ''}: "
        f"every rank's output and dq, dk, dv equal one-process attention (largest difference {truth:.1g} < "
        f"{TRUTH:g}) and torch's own ring attention ({theirs:.1g} < {TORCH:g}); each rank's forward computed "
        f"only the blocks it needs."), results)
    if keep is not None:
        keep["causal" if causal else "ring"] = checked
    return checked


def _merge_first(path: str | Path) -> str | None:
    try:
        problem = merge_problem(load_module(path).merge)
    except Exception as error:
        return f"importing {Path(path).name} failed: {type(error).__name__}: {error}"
    return f"merge first (check_merge): {problem}" if problem else None


# --------------------------------------------------------------------------------------------- exercise 4


def moe_problem(per_rank: dict[int, dict]) -> str | None:
    """The first thing wrong in one launch's results of one MoE file, or None."""
    first = per_rank[min(per_rank)]
    if "error" in first:
        return f"the check ran into {first['error']}"
    for factor in first:
        for rank, graded in sorted(per_rank.items()):
            got = graded[factor]
            where = f"{len(per_rank)} ranks, capacity factor {factor}, rank {rank}"
            problem = _moe_output_problem(got) or _moe_gradient_problem(got)
            if problem:
                return f"{where}: {problem}"
    return None


def _moe_output_problem(got: dict) -> str | None:
    if got["shape"] != [got["tokens"], 8]:
        return f"the layer returned {got['shape']}; it should return one row per token, [{got['tokens']}, 8]."
    if got["kept"] is None:
        return "the layer did not set self.kept to a bool tensor [tokens, 2] (which assignments it processed)."
    kept, want = torch.tensor(got["kept"]), torch.tensor(got["want_kept"])
    if not torch.equal(kept, want):
        diff = torch.nonzero(kept != want).tolist()[:3]
        limit = got["limit"]
        if limit is None:
            return (f"with no capacity factor every assignment is kept, but self.kept drops {int((~kept).sum())}: "
                    f"the first at (token, choice) {diff}.")
        return (f"the layer kept {int(kept.sum())} of the {kept.numel()} assignments, the reference keeps "
                f"{int(want.sum())} (capacity {limit} per expert on each rank: every token's first choice before any "
                f"second choice, earlier tokens first, counted on the sending rank before anything travels); they "
                f"differ at (token, choice) {diff}.")
    if got["out"] <= TRUTH:
        return None
    if "wrong expert" in got["matches"]:
        return ("the output equals a layer whose rank sends expert e's tokens to rank e % N: expert e lives on rank "
                "e // (experts per rank), and rows must arrive grouped by that rank's local expert.")
    if "unweighted" in got["matches"]:
        return "the output equals the experts' outputs added without the router's weights: multiply each by its weight."
    return f"the output differs from the one-process layer by up to {got['out']:.2g} (more than {TRUTH:g})."


def _moe_gradient_problem(got: dict) -> str | None:
    if got.get("backward_error"):
        return "the output does not require grad: the tokens must reach the experts through an autograd-aware all-to-all."
    for name, what in (("x", "the tokens"), ("router", "the router's weight (this rank's tokens' share)"),
                       ("experts", "this rank's experts' weights")):
        if got[name] > TRUTH:
            return (f"the output is right but the gradient of {what} differs from the one-process layer's by up to "
                    f"{got[name]:.2g}: a plain dist.all_to_all_single has no backward; use "
                    "all_to_all_single_autograd, whose backward sends the gradients back the way the rows came.")
    return None


def check_moe(path: str | Path, keep: dict | None = None, timeout: float = 60,
              sizes: tuple[int, ...] = SIZES) -> Checked:
    """Exercise 4: the learner's ExpertParallelMoE on 2 and then 4 ranks, with and without a capacity factor."""
    results = {}
    for nproc in sizes:
        print(f"Checking on {nproc} ranks...", flush=True)
        run, failed = _launch("experts_check.py", nproc, ["--impl", str(Path(path).resolve())], timeout,
                              f"the expert-parallel check of {Path(path).name}")
        if failed:
            return Checked(not_yet(failed))
        per_rank = {rank: got["graded"][str(Path(path).resolve())] for rank, got in run.results.items()}
        problem = moe_problem(per_rank)
        if problem:
            return Checked(not_yet(problem), results)
        results[nproc] = per_rank
    worst = max(g[n] for r in results.values() for by_factor in r.values() for g in by_factor.values()
                for n in ("out", "x", "router", "experts"))
    dropped = {n: sum(sum(1 for row in g["1.0"]["kept"] for k in row if not k) for g in r.values())
               for n, r in results.items()}
    checked = Checked(correct(
        f"on {' and '.join(map(str, sizes))} ranks every rank's output and the gradients of its tokens, the router "
        f"and its experts equal the one-process layer (largest difference {worst:.1g} < {TRUTH:g}); with capacity "
        f"factor 1.0 the same assignments were dropped as in one process ("
        + ", ".join(f"{d} on {n} ranks" for n, d in dropped.items()) + ")."), results)
    if keep is not None:
        keep["moe"] = checked
    return checked


# --------------------------------------------------------------------------------------------- for the tests


def grade_many(kind: str, paths: list[str | Path], nproc: int, causal: bool = False,
               timeout: float = 120) -> dict[str, str | None]:
    """Grade several files in ONE launch (tests): {file: the Not yet sentence, or None when it passes}. Only files
    whose ranks fail alike may share a launch (an exception on one rank alone leaves the others waiting)."""
    worker = {"ring": "context_check.py", "moe": "experts_check.py"}[kind]
    files = [str(Path(p).resolve()) for p in paths]
    run = launch(WORKERS / worker, nproc=nproc, echo=False, timeout=timeout,
                 args=["--impl", *files] + (["--causal"] if causal else []))
    verdicts = {}
    for file in files:
        per_rank = {rank: got["graded"][file] for rank, got in run.results.items()}
        verdicts[file] = ring_problem(per_rank, causal) if kind == "ring" else moe_problem(per_rank)
    return verdicts
