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
import sys
from pathlib import Path
from typing import Any

import torch

from helpers import LaunchTimeout, WorkerFailed, launch
from helpers.kit import WORKERS
from helpers.kit.context_experts import DIM, block_attention, layout
from helpers.launcher.api import launch_server_pid
from helpers.lessons.checks import correct, each_rank, explain_crash, not_yet

# A float32 ring against one-process attention in float64 (the bar), and against torch's own float32 ring.
# Both rings are float32 sums of the same terms in different orders; each lands within about 1e-6 of the float64
# truth here (the check hands back torch's own error, "torch_vs_truth"), so the two can differ by about twice that.
# 5e-6 leaves room for that and still fails a ring off by more than float32's rounding of values up to ~3 (30 eps).
TRUTH, TORCH = 1e-5, 5e-6
SIZES = (2, 4)


class Checked:
    """What a launching check hands back: true when it passed; `.results[world_size]` holds every rank's results."""

    def __init__(self, passed: bool, results: dict[int, dict] | None = None, path: str | None = None) -> None:
        self.passed, self.results, self.path = passed, results or {}, path

    def __bool__(self) -> bool:
        return self.passed


def _checking(nproc: int, timeout: float, first: bool) -> None:
    """The line a check prints before each launch; the first also says how long a hang may last, and whether this
    kernel's launch server starts first (it imports torch, the longest wait of a first check)."""
    if first and launch_server_pid() is None and sys.platform.startswith("linux"):
        print("Starting this kernel's launch server first: it imports torch once, so this first check takes longer.",
              flush=True)
    print(f"Checking on {nproc} ranks" + (f" (a run that hangs is stopped after {timeout:g} s)" if first else "")
          + "...", flush=True)


def _launch(worker: str, nproc: int, args: list[str], timeout: float, what: str) -> tuple[Any, str | None]:
    """One launch: (run, None), or (None, the sentence a learner reads) when it crashed or hung."""
    try:
        return launch(WORKERS / worker, nproc=nproc, echo=False, timeout=timeout, args=args), None
    except LaunchTimeout as error:
        blocking = any("in dist.recv " in line for line in error.where.values())
        return None, (f"{what} on {nproc} ranks did not finish within {timeout:g} s; where each rank was waiting:"
                      f"{each_rank(error.where)}. A rank that waits in a receive or a collective its peer never "
                      f"joins: check which rank each send goes to and which each receive expects"
                      + ("; in a ring, wait() both requests of a step before using `incoming` and before the next "
                         "step's isend." if worker == "context_check.py" else ".")
                      + (" A blocking dist.recv returns only once its peer has sent: when every rank receives before "
                         "it sends, none sends; start the isend first." if blocking else ""))
    except WorkerFailed as error:  # what not_yet_crashed says: the rank, the learner's line, what gloo's check means
        return None, explain_crash(error, f"{what} on {nproc} ranks")


# --------------------------------------------------------------------------------------------- exercise 1


def load_module(path: str | Path) -> Any:
    """Import a learner's file afresh (edits since the last import are seen)."""
    path = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(f"learner_{path.stem}_{path.stat().st_mtime_ns}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The merge check's cases: (what, score scale, bar). The truth is attention over all 12 keys in float64, from the same
# float32 q, k, v. float32 holds a log-sum-exp near 276 only to half its spacing there (the spacing in [256, 512) is
# 2**-15 = 3.1e-5, half of it 1.5e-5), and that rounding scales both blocks' weights: a right merge's output can be
# off by that much times |out| (up to ~3.2 here),
# so the large case's bar is 1e-4; a wrong merge (the mistakes named below) is off by 0.05 or more.
MERGE_CASES = (("ordinary scores", 1.0, TRUTH), ("large scores (log-sum-exp up to 276)", 80.0, 1e-4))


def _merge_cases() -> list[tuple[str, tuple, tuple, float]]:
    """(what, the two blocks' (out, lse, out, lse) in float32, the truth (out, lse) in float64, the bar)."""
    generator = torch.Generator().manual_seed(0)
    cases = []
    for what, scale, bar in MERGE_CASES:
        q = torch.randn(1, 2, 5, 8, generator=generator) * scale
        k, v = torch.randn(1, 2, 12, 8, generator=generator), torch.randn(1, 2, 12, 8, generator=generator)
        first = block_attention(q, k[..., :7, :], v[..., :7, :])
        second = block_attention(q, k[..., 7:, :], v[..., 7:, :])
        cases.append((what, (*first, *second), block_attention(q.double(), k.double(), v.double()), bar))
    return cases


def _e(bar: float) -> str:
    return f"{bar:.0e}".replace("e-0", "e-")


def merge_problem(merge: Any) -> str | None:
    """The first thing wrong with a learner's merge(out, lse, block_out, block_lse), or None."""
    for what, blocks, (want_out, want_lse), bar in _merge_cases():
        try:
            got = merge(*blocks)
        except Exception as error:  # the learner's own code: any error is theirs to see, with their line
            return f"merge raised {type(error).__name__}: {error}{_merge_crash_where(merge, error)}"
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
        if (out.double() - want_out).abs().max() > bar:
            hint = _merge_hint(out, (out_1, lse_1, out_2, lse_2), bar)
            return f"with {what} the merged output differs from attention over both blocks" + hint
        if ((lse.double() - want_lse).abs() / want_lse.abs().clamp_min(1)).max() > TRUTH:  # relative: near 276
            if torch.allclose(lse, torch.maximum(lse_1, lse_2)):
                return ("the merged output is right but the new lse is the larger of the two: it must be "
                        "log(exp(lse) + exp(block_lse)), what the next block's merge weighs against")
            if torch.allclose(lse, lse_1) or torch.allclose(lse, lse_2):
                return ("the merged output is right but merge returned one block's lse unchanged: the new lse is "
                        "log(exp(lse) + exp(block_lse)), what the next block's merge weighs against")
            return "the merged output is right but the new lse is not log(exp(lse) + exp(block_lse))"
    return None


def _merge_crash_where(merge: Any, error: Exception) -> str:
    """Where in the learner's file merge crashed, and what a size mismatch there usually means."""
    import traceback

    file = getattr(getattr(merge, "__code__", None), "co_filename", None)
    lines = [frame.lineno for frame in traceback.extract_tb(error.__traceback__) if frame.filename == file]
    where = f" (at {Path(file).name}:{lines[-1]})" if lines else ""
    if isinstance(error, RuntimeError) and "must match the size of tensor" in str(error):
        where += (". out is [..., queries, d] and lse [..., queries]: a weight computed from lse multiplies out "
                  "only after .unsqueeze(-1)")
    return where


def empty_start_problem(merge: Any) -> str | None:
    """What a merge into an empty start (out = 0, lse = -inf: no key seen yet) gets wrong, or None. Not required by
    exercise 1 (a ring may start from its first block, as torch's and ours do), but a ring that starts empty needs it:
    torch's sigmoid form gives lse = -inf - logsigmoid(-inf) = -inf + inf = nan there."""
    _, (_, _, block_out, block_lse), _, _ = _merge_cases()[0]
    try:
        out, lse = merge(torch.zeros_like(block_out), torch.full_like(block_lse, float("-inf")), block_out, block_lse)
        if torch.allclose(out, block_out) and torch.allclose(lse, block_lse):
            return None
        bad = "nan" if (torch.isnan(out).any() or torch.isnan(lse).any()) else "a wrong result"
    except Exception as error:  # the learner's own code
        bad = f"{type(error).__name__}: {error}"
    return (f"merging a block into an empty start (out = 0, lse = -inf) gives {bad}, where it should give the block "
            "itself: in torch's sigmoid form lse - logsigmoid(lse - block_lse) is -inf + inf = nan when lse = -inf. "
            "Start each query chunk from its first block's (out, lse) instead, or merge with torch.logaddexp")


def _merge_hint(out: torch.Tensor, blocks: tuple, bar: float) -> str:
    out_1, lse_1, out_2, lse_2 = blocks
    if torch.allclose(out, out_2) or torch.allclose(out, out_1):
        return ": it equals one block's output (the other block was dropped)."
    if torch.allclose(out, (out_1 + out_2) / 2, atol=bar):
        return (": it is the plain average of the two outputs; weigh each by its share of the softmax's "
                "denominator, exp(lse_i - new_lse).")
    if torch.allclose(out, out_1 + out_2, atol=bar):
        return ": it is the sum of the two outputs; weigh each by exp(lse_i - new_lse), which add up to 1."
    new = torch.logaddexp(lse_1, lse_2).unsqueeze(-1)
    weight_1, weight_2 = torch.exp(lse_1.unsqueeze(-1) - new), torch.exp(lse_2.unsqueeze(-1) - new)
    if torch.allclose(out, out_1 + weight_2 * out_2, atol=bar):
        return (": it is out + exp(block_lse - new_lse) * block_out; the old accumulator out is not rescaled. It was "
                "a softmax over the old keys only: multiply it by exp(lse - new_lse) too.")
    if torch.allclose(out, weight_1 * out_1 + out_2, atol=bar):
        return (": it is exp(lse - new_lse) * out + block_out; the new block's output is not rescaled. Multiply it by "
                "exp(block_lse - new_lse) too.")
    largest = torch.maximum(lse_1, lse_2).unsqueeze(-1)
    unnormalised = torch.exp(lse_1.unsqueeze(-1) - largest) * out_1 + torch.exp(lse_2.unsqueeze(-1) - largest) * out_2
    if torch.allclose(out, unnormalised, atol=bar):
        return (": the weights exp(lse_i - max) do not add up to 1; divide by their sum (equivalently, use "
                "exp(lse_i - new_lse)).")
    return f" by up to {float((out - _truth_of(blocks)).abs().max()):.2g}."


def _truth_of(blocks: tuple) -> torch.Tensor:
    out_1, lse_1, out_2, lse_2 = (t.double() for t in blocks)
    new = torch.logaddexp(lse_1, lse_2).unsqueeze(-1)
    return torch.exp(lse_1.unsqueeze(-1) - new) * out_1 + torch.exp(lse_2.unsqueeze(-1) - new) * out_2


def merge_figure() -> Any:
    """One query over 12 keys in two blocks (7 + 5): each block's own softmax weights, and the same weights rescaled
    by exp(lse_block - lse_all), which is what the merge does; computed here, in this process."""
    import matplotlib.pyplot as plt

    generator = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 8, generator=generator), torch.randn(12, 8, generator=generator)
    scores = (q @ k.t()).squeeze(0) / math.sqrt(8)
    blocks = (scores[:7], scores[7:])
    lses = [torch.logsumexp(b, 0) for b in blocks]
    total = torch.logsumexp(scores, 0)
    fig, axes = plt.subplots(1, 2, figsize=(10, 2.8), dpi=80, layout="constrained", sharey=True)
    for start, block, lse, colour in ((0, blocks[0], lses[0], "tab:blue"), (7, blocks[1], lses[1], "tab:orange")):
        keys, weights = list(range(start, start + len(block))), torch.softmax(block, 0)
        axes[0].bar(keys, weights.tolist(), color=colour,
                    label=f"block of keys {start}-{start + len(block) - 1}: lse {lse:.2f}, weights sum to 1")
        axes[1].bar(keys, (weights * torch.exp(lse - total)).tolist(), color=colour,
                    label=f"x exp({lse:.2f} - {total:.2f}) = x {torch.exp(lse - total):.2f}")
    axes[1].plot(range(12), torch.softmax(scores, 0).tolist(), "k_", markersize=14, label="softmax over all 12 keys")
    axes[0].set(title="each block on its own", xlabel="key", ylabel="attention weight")
    axes[1].set(title=f"merged: lse = log(exp({lses[0]:.2f}) + exp({lses[1]:.2f})) = {total:.2f}", xlabel="key")
    axes[0].set_ylim(top=axes[0].get_ylim()[1] * 1.6)  # room above the tallest bar for the legends
    for ax in axes:
        ax.legend(fontsize=8, loc="upper left")
    return fig


def check_merge(path: str | Path) -> bool:
    """Exercise 1: `merge` in the learner's file, in this process (no launch)."""
    try:
        merge = load_module(path).merge
    except Exception as error:
        return not_yet(f"importing merge from {Path(path).name} failed: {type(error).__name__}: {error}")
    problem = merge_problem(merge)
    if problem:
        return not_yet(problem)
    worst = [float((merge(*blocks)[0].double() - want[0]).abs().max()) for _, blocks, want, _ in _merge_cases()]
    note = empty_start_problem(merge)
    return correct(f"merge gives attention over both blocks, output and log-sum-exp, for ordinary scores (max abs diff "
                   f"{worst[0]:.1g} < {_e(MERGE_CASES[0][2])}) and for scores whose log-sum-exp reaches 276 "
                   f"({worst[1]:.1g} < {_e(MERGE_CASES[1][2])}, the bar float32's rounding of so large an lse "
                   "allows)."
                   + (f" A caution for exercise 2: {note}." if note else ""))


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
    "causal ignored": ("attention without any mask: causal=True is ignored, so every query also sees the keys that "
                       "come after it (the picture of section 4 shows which blocks a causal ring computes)"),
    "blocks above the diagonal masked": ("a ring that computes the blocks above the diagonal with the triangular "
                                         "mask: that mask is for the diagonal block only (a query chunk meeting its "
                                         "own keys); a block whose keys all come after the queries is skipped"),
    "block labelled one step off": ("a ring that reads the chunk numbers of the block it holds at step s from the "
                                    "previous or the next step's rank: the block at step s is rank (rank - s) mod N's, "
                                    "so its chunks are layout[(rank - s) % N], and the causal mask decides by those "
                                    "numbers which blocks to compute, mask or skip"),
}


def _where(rank: int, kind: str, world_size: int) -> str:
    return f"{world_size} ranks, {kind} layout {layout(kind, world_size)}, rank {rank}"


GENERIC = "the output differs from one-process attention over the whole sequence"
BY_RANK_ADVICE = (" The contiguous layout passed, so a rule on ranks and steps can hold there; in the balanced "
                  "layout a rank's two chunks lie on both sides of the others', so decide each block by its chunk "
                  "numbers.")


def ring_problem(per_rank: dict[int, dict], causal: bool, merge_note: str | None = None) -> str | None:
    """The first thing wrong in one launch's results of one file, as the sentence after "Not yet: ", or None.
    merge_note: empty_start_problem of the file's merge (what a nan output may come from)."""
    first = per_rank[min(per_rank)]
    if "error" in first:
        return f"the check ran into {first['error']}"
    for kind in first:
        for find in (_wait_problem, lambda got: _output_problem(got, causal, merge_note),  # waits, outputs first
                     lambda got: _gradient_problem(got, causal), lambda got: _work_problem(got, causal)):
            for rank, graded in sorted(per_rank.items()):
                problem = find(graded[kind])
                if problem:
                    if causal and kind == "balanced" and problem.startswith(GENERIC):  # the contiguous layout passed
                        problem += BY_RANK_ADVICE
                    return f"{_where(rank, kind, len(graded[kind]['layout']))}: {problem}"
    return None



WAIT_ADVICE = ("wait() both requests before using `incoming` (this check keeps a receive's buffer at NaN until its "
               "request's wait() returns; on a real run the block may simply not have arrived yet)")


def _wait_problem(got: dict) -> str | None:
    """Receives (dist.irecv) that the forward or the backward started and never waited for."""
    for when in ("forward", "backward"):
        unwaited = (got.get(when) or {}).get("unwaited", 0)
        if unwaited:
            return (f"the {when} started {unwaited} receive(s) with dist.irecv and never called wait() on them: "
                    f"{WAIT_ADVICE}.")
    return None


def _output_problem(got: dict, causal: bool, merge_note: str | None = None) -> str | None:
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
        if merge_note:  # the merge's own nan comes first: it happens with or without a mask
            also = (" (With a causal mask a block whose every score is masked gives nan too: skip such blocks.)"
                    if causal else "")
            return f"the output holds nan, and your merge gives nan in one case: {merge_note}.{also}"
        if causal:
            return ("the output holds nan: a block whose every score is masked leaves softmax nothing to divide by "
                    "(skip blocks whose keys all come after the queries instead of masking them), or a received "
                    f"block was used before its wait(): {WAIT_ADVICE}.")
        return ("the output holds nan (there is no mask in this check): look for a 0 / 0, an inf - inf, or a "
                f"received block used before its wait(): {WAIT_ADVICE}.")
    matches = got["matches"]
    if matches["steps"]:
        seen = "its own chunks only" if matches["steps"] == 1 else f"the blocks of the first {matches['steps']} steps"
        return (f"the output equals attention over {seen} of the ring; the ring has {world_size} steps, and every "
                "query must see the keys of every rank (that come before it, with a causal mask).")
    for mistake in MISTAKE_ADVICE:
        if mistake in matches["mistakes"]:
            return f"the output equals {MISTAKE_ADVICE[mistake]}."
    return (f"{GENERIC} by up to {error:.2g} (more "
            f"than {TRUTH:g}).")


def _gradient_problem(got: dict, causal: bool = False) -> str | None:
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
                f"{error:.2g} (more than {TRUTH:g})."
                + (" With causal=True the backward must follow the forward's rule: mask the diagonal block and "
                   "skip the blocks above it." if causal else ""))
    for name, error in got["vs_torch"].items():
        if error > TORCH:
            tensor = name if name == "out" else "d" + name
            return (f"every tensor is within {TRUTH:g} of one-process attention, but {tensor} differs from torch's "
                    f"own ring attention by {error:.2g} (more than {TORCH:g}).")
    return None


def ring_design(per_rank: dict[int, dict]) -> str:
    """What moved k and v in the learner's forward, from the calls our CommCounter saw: point-to-point sends (a ring
    when every rank sent to one peer and received from one), an all-gather, or an all-to-all. Only the calls: what a
    rank holds at once is not seen here."""
    ops = {e["op"] for graded in per_rank.values() for got in graded.values() for e in got["forward"]["events"]}
    if "send" in ops:
        peers = [{(e["op"], e.get("peer")) for e in got["forward"]["events"] if e["op"] in ("send", "recv")}
                 for graded in per_rank.values() for got in graded.values()]
        sent_to = max(len({peer for op, peer in seen if op == "send"}) for seen in peers)
        taken_from = max(len({peer for op, peer in seen if op == "recv"}) for seen in peers)
        if any(peer is None for seen in peers for _, peer in seen):
            return "point-to-point: k and v passed on with send/receive"
        if sent_to == taken_from == 1:
            return ("a ring: k and v passed on with send/receive, each rank sending to one peer and receiving from "
                    "one")
        return (f"point-to-point, not a ring: a rank sent k and v to up to {sent_to} peers and received from up to "
                f"{taken_from}")
    if "all_gather" in ops:
        return ("an all-gather, not a ring: every rank gathered every block of k and v and held all N at once "
                "(it computes the same blocks; section 6 measures what holding them costs)")
    if "all_to_all" in ops:
        return "a rotation by all-to-all (torch's \"alltoall\" method): each rank sends its block to the next"
    return f"no communication our counter recognises (it saw {sorted(ops) or 'none'})"


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
    merge_note = empty_start_problem(load_module(path).merge)
    results = {}
    what = f"the {'causal ' if causal else ''}ring attention check of {Path(path).name}"
    for nproc in sizes:
        _checking(nproc, timeout, first=nproc == sizes[0])
        run, failed = _launch("context_check.py", nproc, ["--impl", str(Path(path).resolve())]
                              + (["--causal"] if causal else []), timeout, what)
        if failed:
            return Checked(not_yet(failed))
        per_rank = {rank: got["graded"][str(Path(path).resolve())] for rank, got in run.results.items()}
        problem = ring_problem(per_rank, causal, merge_note)
        if problem:
            return Checked(not_yet(problem), results)
        results[nproc] = per_rank
    truth = max(g["vs_truth"][n] for r in results.values() for g_kind in r.values() for g in g_kind.values()
                for n in ("out", "q", "k", "v"))
    theirs = max(g["vs_torch"][n] for r in results.values() for g_kind in r.values() for g in g_kind.values()
                 for n in ("out", "q", "k", "v"))
    checked = Checked(correct(
        f"on {' and '.join(map(str, sizes))} ranks, contiguous and balanced layouts{', causal' if causal else ''}: "
        f"every rank's output and dq, dk, dv equal one-process attention in float64 (max abs diff {truth:.1g} < "
        f"{TRUTH:g}) and torch's own ring attention (max abs diff {theirs:.1g} < {TORCH:g}); each rank's forward "
        f"computed only the blocks it needs. Your design: {ring_design(results[max(results)])}."),
        results, str(Path(path).resolve()))
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
        return moe_crash_advice(f"the check ran into {first['error']}")
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
    if "own experts only" in got["matches"]:
        return ("the output equals a layer that runs only this rank's own experts: a token whose choice lives on "
                "another rank must travel there (the all-to-all) and its result come back.")
    if "unweighted" in got["matches"]:
        return ("the output equals the experts' outputs added without the router's weights: multiply each by its "
                "weight.")
    if "gate applied twice" in got["matches"]:
        return ("the output equals a layer that applies the router's weight twice: to the rows before the experts "
                "and to their results again. Apply it once; this layer weights the experts' results (weighting "
                "the rows instead, as torchtitan's since-removed score_before_experts=True did, is another layer).")
    if "gate before the experts" in got["matches"]:
        return ("the output equals a layer that weights the rows before the experts (torchtitan's "
                "score_before_experts=True, since removed): a different layer, since an expert is not linear. This "
                "one weights the experts' results.")
    return f"the output differs from the one-process layer by up to {got['out']:.2g} (more than {TRUTH:g})."


def _moe_gradient_problem(got: dict) -> str | None:
    if got.get("backward_error"):
        return ("the output does not require grad: the tokens must reach the experts through an autograd-aware "
                "all-to-all.")
    for name, what in (("x", "the tokens"), ("router", "the router's weight (this rank's tokens' share)"),
                       ("experts", "this rank's experts' weights")):
        if got[name] > TRUTH:
            return (f"the output is right but the gradient of {what} differs from the one-process layer's by up to "
                    f"{got[name]:.2g}: a plain dist.all_to_all_single has no backward; use "
                    "all_to_all_single_autograd, whose backward sends the gradients back the way the rows came.")
    return None


def moe_crash_advice(failed: str) -> str:
    """A crash message of the MoE check, with what the two errors of an uneven all-to-all usually mean."""
    if "expected size" in failed:  # gloo's size check, in an all-to-all with uneven splits
        failed += (" In an uneven all-to-all, each rank must be told how many rows every peer sends it: exchange "
                   "the counts first (dist.all_to_all_single of the counts), and pass them as output_split_sizes. "
                   "(gloo checks the sizes; NCCL does not: with counts that disagree it reads or writes the wrong "
                   "rows, or waits for rows that never come.)")
    elif "Split sizes doesn't match total dim 0 size" in failed:  # torch's own check of input_split_sizes
        failed += (" An all-to-all's input_split_sizes must add up to the rows of the tensor it sends. If this is "
                   "the way back: the results travel back to where their rows came from, so the return trip takes "
                   "the dispatch's splits swapped (output_split_sizes = what you sent, input_split_sizes = what you "
                   "received).")
    return failed


def check_moe(path: str | Path, keep: dict | None = None, timeout: float = 60,
              sizes: tuple[int, ...] = SIZES) -> Checked:
    """Exercise 4: the learner's ExpertParallelMoE on 2 and then 4 ranks, with and without a capacity factor."""
    results = {}
    for nproc in sizes:
        _checking(nproc, timeout, first=nproc == sizes[0])
        run, failed = _launch("experts_check.py", nproc, ["--impl", str(Path(path).resolve())], timeout,
                              f"the expert-parallel check of {Path(path).name}")
        if failed:
            failed = moe_crash_advice(failed)
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
        f"and its experts equal the one-process layer (max abs diff {worst:.1g} < {TRUTH:g}); with capacity "
        f"factor 1.0 the same assignments were dropped as in one process ("
        + ", ".join(f"{d} on {n} ranks" for n, d in dropped.items()) + ")."), results, str(Path(path).resolve()))
    if keep is not None:
        keep["moe"] = checked
    return checked


# --------------------------------------------------------------------------------------------- the planner, checked


class _DenseAndExperts(torch.nn.Module):
    """A stand-in for one rank's weights: dense layers every rank of the model replica holds, and this rank's experts
    (every expert runs on every row: what FSDP gathers and reduces does not depend on the routing)."""

    def __init__(self, width: int, dense_layers: int, local_experts: int) -> None:
        super().__init__()
        self.dense = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16)
                                           for _ in range(dense_layers)])
        self.experts = torch.nn.ModuleList(torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16)
                                           for _ in range(local_experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.dense(x)
        return h + sum(expert(h) for expert in self.experts)


def fsdp_held_and_sent(dp: int, cp: int, ep: int, width: int = 64, dense_layers: int = 2,
                       num_experts: int = 4) -> dict[str, Any]:
    """Torch's own accounting of the layout our planner assumes, for rank 0 of dp x cp simulated ranks (lesson 11's
    fake backend: every collective returns at once and moves no data). fully_shard (FSDP2, ZeRO-3) shards the dense
    layers over all dp x cp ranks, which hold the same dense weights, and each of this rank's num_experts / ep experts
    over the dp x cp / ep ranks that hold the same experts (torchtitan's fsdp and efsdp mesh dimensions). One bf16
    forward and backward; returns the parameters in the model, the bytes of the parameter and gradient shards rank 0
    holds, and the bytes it sends, from the arguments of the all-gathers and reduce-scatters FSDP2 called
    (helpers.kit.context_experts.CommCounter, each with its own group's size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from helpers.kit.context_experts import CommCounter
    from helpers.lessons.scale import simulated_world

    world = dp * cp
    if world % ep or num_experts % ep:
        raise ValueError(f"ep = {ep} must divide dp x cp = {world} and the {num_experts} experts")
    with simulated_world(world, rank=0):
        everyone = init_device_mesh("cpu", (world,))
        sparse = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        model = _DenseAndExperts(width, dense_layers, num_experts // ep)
        for expert in model.experts:
            fully_shard(expert, mesh=sparse["efsdp"])
        fully_shard(model.dense, mesh=everyone)
        fully_shard(model, mesh=everyone)
        counter = CommCounter(0, world)
        with counter:
            model(torch.ones(2, width, dtype=torch.bfloat16)).float().sum().backward()
        events = counter.take()
        params = list(model.parameters())
        return {"n_params": (dense_layers + num_experts) * width * width,
                "expert_params": num_experts * width * width,
                "weights": sum(p.to_local().numel() * p.to_local().element_size() for p in params),
                "gradients": sum(p.grad.to_local().numel() * p.grad.to_local().element_size() for p in params),
                "sent": sum(e["sent"] for e in events),
                "calls": sorted({(e["op"], e["group"]) for e in events})}


PLANNER_LAYOUTS = ((4, 1, 1), (2, 2, 1), (1, 2, 1), (4, 1, 2), (2, 2, 4))  # (dp, cp, ep)


def planner_against_fsdp(layouts: tuple[tuple[int, int, int], ...] = PLANNER_LAYOUTS) -> list[dict[str, Any]]:
    """For each (dp, cp, ep): what rank 0 held and sent under FSDP2 (fsdp_held_and_sent) beside our planner's ZeRO-3
    fp16 weights, fp16 gradients and dp traffic for the same parameters. Prints a table; returns its rows."""
    from helpers.lessons.scale import plan

    rows = []
    print(f"{'dp':>3} {'cp':>3} {'ep':>3} | {'weights held: FSDP2':>19} {'planner':>8} | {'gradients: FSDP2':>16} "
          f"{'planner':>8} | {'sent: FSDP2':>11} {'planner':>8} | FSDP2's calls (op, group size)")
    for dp, cp, ep in layouts:
        got = fsdp_held_and_sent(dp, cp, ep)
        planned = plan(got["n_params"], dp, cp=cp, ep=ep, expert_params=got["expert_params"], stage="ZeRO-3")
        row = {"layout": (dp, cp, ep), **got, "planned": {"weights": planned["memory"]["fp16 weights"],
                                                          "gradients": planned["memory"]["fp16 gradients"],
                                                          "sent": planned["traffic"]["dp"]}}
        rows.append(row)
        print(f"{dp:>3} {cp:>3} {ep:>3} | {got['weights']:>19,} {row['planned']['weights']:>8,.0f} | "
              f"{got['gradients']:>16,} {row['planned']['gradients']:>8,.0f} | {got['sent']:>11,} "
              f"{row['planned']['sent']:>8,.0f} | {', '.join(f'{op} {n}' for op, n in got['calls'])}")
    return rows


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
        if kind == "ring":
            verdicts[file] = ring_problem(per_rank, causal, empty_start_problem(load_module(file).merge))
        else:
            verdicts[file] = moe_problem(per_rank)
    return verdicts


# --------------------------------------------------------------------------------------------- pictures and tables

RANK_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red")


def ring_figure(world_size: int = 4) -> Any:
    """Which rank's keys and values each rank holds at each step of the ring (a drawing of the design, not a run)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * world_size + 1.5, 0.55 * world_size + 1.1), dpi=80, layout="constrained")
    for step in range(world_size):
        for rank in range(world_size):
            source = (rank - step) % world_size
            ax.add_patch(plt.Rectangle((step, world_size - 1 - rank), 0.92, 0.85, color=RANK_COLOURS[source],
                                       alpha=0.75))
            ax.text(step + 0.46, world_size - 0.58 - rank, f"k, v of {source}", ha="center", va="center", fontsize=9)
    ax.set(xlim=(-0.1, world_size), ylim=(-0.1, world_size), xticks=[s + 0.46 for s in range(world_size)],
           xticklabels=[f"step {s}" for s in range(world_size)],
           yticks=[world_size - 0.58 - r for r in range(world_size)],
           yticklabels=[f"rank {r}" for r in range(world_size)],
           title="ring attention: at step s each rank holds the keys and values of rank (rank - s) mod N,\n"
                 "computes its queries against them, and passes them to rank + 1")
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    return fig


def blocks_figure(world_size: int = 4) -> Any:
    """The causal score blocks, query chunk x key chunk in sequence order, coloured by the rank that computes them, for
    both layouts (a drawing of the rule in helpers.kit.context_experts.block_pairs, not a run)."""
    import matplotlib.pyplot as plt

    from helpers.kit.context_experts import LAYOUTS, block_pairs

    fig, axes = plt.subplots(1, 2, figsize=(9, 4.2), dpi=80, layout="constrained")
    for ax, kind in zip(axes, LAYOUTS, strict=True):
        chunk_layout = layout(kind, world_size)
        n = sum(len(row) for row in chunk_layout)
        for rank, mine in enumerate(chunk_layout):
            for theirs in chunk_layout:
                for i, j, diagonal in block_pairs(mine, theirs, causal=True):
                    a, b = mine[i], theirs[j]
                    ax.add_patch(plt.Rectangle((b, n - 1 - a), 1, 1, color=RANK_COLOURS[rank],
                                               alpha=0.45 if diagonal else 0.9, lw=0))
                    if diagonal:
                        ax.plot([b, b + 1], [n - a, n - 1 - a], color="k", lw=0.6)
        work = [sum(1 for theirs in chunk_layout for _ in block_pairs(mine, theirs, True)) for mine in chunk_layout]
        ax.set(xlim=(0, n), ylim=(0, n), aspect="equal", xlabel="key chunk (sequence order)", ylabel="query chunk",
               title=f"{kind} ({n} chunks)\nscore blocks per rank {work}")
        ax.set_xticks([x + 0.5 for x in range(n)], [str(x) for x in range(n)])  # labels in the rows and columns
        ax.set_yticks([y + 0.5 for y in range(n)], [str(n - 1 - y) for y in range(n)])
        ax.set_xticks(range(n + 1), minor=True)
        ax.set_yticks(range(n + 1), minor=True)
        ax.tick_params(which="minor", length=0)
        ax.grid(True, which="minor", lw=0.3)
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color=c) for c in RANK_COLOURS[:world_size]],
               labels=[f"rank {r}" for r in range(world_size)], loc="outside right upper", fontsize=9)
    fig.suptitle("causal attention: blank blocks are skipped, half-shaded diagonal blocks are masked inside",
                 fontsize=10)
    return fig


def work_table(checked: Checked | None) -> dict[int, dict[str, list[int]]]:
    """Forward FLOPs per rank in the causal check run (FlopCounterMode), ours and torch's ring, for both layouts:
    {world_size: {"contiguous": [...], "balanced": [...], "torch contiguous": [...], "torch balanced": [...]}}."""
    if not checked:
        print("(no results yet: the causal check has not passed)")
        return {}
    table = {}
    for world_size, per_rank in sorted(checked.results.items()):
        ranks = sorted(per_rank)
        print(f"{world_size} ranks, forward FLOPs per rank (FlopCounterMode):")
        for kind in per_rank[ranks[0]]:
            ours = [per_rank[r][kind]["forward"]["flops"] for r in ranks]
            theirs = [per_rank[r][kind]["torch_flops"] for r in ranks]
            table.setdefault(world_size, {})[kind] = ours
            table[world_size][f"torch {kind}"] = theirs
            print(f"  {kind:<10} ours  {ours}  slowest / mean {max(ours) / (sum(ours) / len(ours)):.2f};  torch's ring "
                  f"{theirs}  slowest / mean {max(theirs) / (sum(theirs) / len(theirs)):.2f}")
    return table


def balance_report(run: Any) -> dict[str, Any]:
    """The timing run of context_balance.py: the step's wall time (slowest rank per round) for both layouts, and each
    rank's own CPU time (the control: the work a rank did itself), with the verdicts."""
    from helpers.kit.timing import Timing, across_ranks, verdict

    per_rank = {rank: {name: Timing.from_dict(t) for name, t in got["timings"].items()}
                for rank, got in sorted(run.results.items())}
    step = across_ranks(got["timings"] for _, got in sorted(run.results.items()))
    wall = verdict(step["contiguous"], step["balanced"])
    print(f"One causal ring-attention step (forward + backward), {run.results[0]['seq']} tokens on "
          f"{len(per_rank)} ranks; a round takes as long as its slowest rank:\n  {wall.sentence}")
    print("Each rank's own CPU time per step (the work it did itself) and forward FLOPs:")
    cpu = {}
    for rank, timings in per_rank.items():
        flops = run.results[rank]["flops"]
        cpu[rank] = {name: t.median("cpu") for name, t in timings.items()}
        print(f"  rank {rank}: contiguous {timings['contiguous'].summary('cpu')} ({flops['contiguous'] / 1e6:.0f} "
              f"MFLOP), balanced {timings['balanced'].summary('cpu')} ({flops['balanced'] / 1e6:.0f} MFLOP)")
    last = max(per_rank)
    control = {}
    for kind in ("contiguous", "balanced"):
        first, other = (Timing(f"rank {r}", per_rank[r][kind].wall, per_rank[r][kind].cpu) for r in (0, last))
        control[kind] = verdict(first, other, kind="cpu")
    for kind, found in control.items():
        print(f"  {kind}: {found.sentence}")
    idle = {kind: step[kind].median("wall") / max(cpu[rank][kind] for rank in cpu) for kind in control}
    print(f"A step's median wall time against the busiest rank's median CPU time: "
          f"contiguous {idle['contiguous']:.1f}x, "
          f"balanced {idle['balanced']:.1f}x. The wall time beyond that rank's CPU time it spent not computing: "
          "waiting for its peer, or for a free CPU. This run records neither the machine's load nor a quiet "
          "machine's run, so it does not say which.")
    return {"wall": wall, "control": control, "cpu": cpu, "wall_over_cpu": idle}


def saved_by_attention(seqs: tuple[int, ...] = (256, 512, 1024, 2048), heads: int = 2,
                       head_dim: int = 16) -> dict[str, list[int]]:
    """Bytes autograd saves for backward from F.scaled_dot_product_attention over S tokens (fp32), in this process,
    with torch's fused CPU kernel and with its math kernel (which keeps the S x S attention weights)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def saved(backend: Any, seq: int) -> int:
        storages = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        q, k, v = (torch.randn(1, heads, seq, head_dim, requires_grad=True) for _ in range(3))
        with sdpa_kernel(backend), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return sum(storages.values())

    return {"seq": list(seqs), "fused": [saved(SDPBackend.FLASH_ATTENTION, s) for s in seqs],
            "math": [saved(SDPBackend.MATH, s) for s in seqs]}


def saved_figure(saved: dict[str, list[int]]) -> Any:
    """saved_by_attention's bytes against the sequence length, and what a rank of 2 or 4 holds (S / N tokens)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=80, layout="constrained")
    seqs = saved["seq"]
    ax.plot(seqs, [b / 2**20 for b in saved["math"]], "o-", label="math kernel (keeps the S x S weights)")
    ax.plot(seqs, [b / 2**20 for b in saved["fused"]], "s-", label="fused kernel (q, k, v, out, log-sum-exp)")
    for n, marker in ((2, "v"), (4, "^")):
        ax.plot(seqs[n // 2:], [b / 2**20 for b in saved["fused"][:len(seqs) - n // 2]], marker + "--",
                label=f"fused, S / {n} tokens: one rank of {n}")
    ax.set(xlabel="tokens in the sequence (S)", ylabel="MiB saved for backward", xscale="log", yscale="log",
           title="one attention layer, 2 heads x 16, fp32: measured in this process")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.set_xticks([], minor=True)  # no log-scale minor labels ("2x10^2") beside the lengths
    ax.legend(fontsize=8)
    return fig


def memory_report(run: Any) -> list[dict[str, Any]]:
    """context_memory.py on rank 0: peak tensor bytes of torch's ring attention on 2 and on 4 ranks, both rotations,
    beside one process holding the whole sequence (float32); then the bytes each rotation sent, in float32 and in
    bfloat16, beside our planner's formula (ring_attention_bytes)."""
    from helpers.lessons.scale import ring_attention_bytes

    got = run.results[0]
    hidden, sizes, rows = got["heads"] * got["head_dim"], got["sizes"], got["rows"]
    print("torch's ring attention, forward + backward, no mask, rank 0. Peak bytes in tensors, float32\n"
          "('q': one of its own q-sized tensors, S / N tokens; ratio: one process / all-to-all):")
    print(f"{'tokens':>7} {'one process':>12} | " + " | ".join(
        f"N={n}: {'all-to-all':>10} {'all-gather':>10} {'ratio':>6}" for n in sizes))
    for row in rows:
        whole = row["one process"]["peak"]
        parts = []
        for n in sizes:
            ring, gather = row[f"N={n} float32 alltoall"], row[f"N={n} float32 allgather"]
            parts.append(f"N={n}: {ring['peak']:>10} {gather['peak']:>10} {whole / ring['peak']:>6.2f}")
        print(f"{row['seq']:>7} {whole:>12} | " + " | ".join(parts))
    last = rows[-1]
    q_bytes = {n: last[f"N={n} float32 alltoall"]["kv_bytes"] / 2 for n in sizes}
    held = {n: last[f"N={n} float32 alltoall"]["peak"] / q_bytes[n] for n in sizes}
    extra = {n: (last[f"N={n} float32 allgather"]["peak"] - last[f"N={n} float32 alltoall"]["peak"]) / (2 * q_bytes[n])
             for n in sizes}
    whole = last["one process"]["peak"] / (q_bytes[sizes[0]] * sizes[0])
    print(f"In q-sized tensors at {last['seq']} tokens: one process peaks at {whole:.1f} whole-sequence tensors; a "
          "ring rank (all-to-all) at " + ", ".join(f"{held[n]:.1f} of its own (N={n})" for n in sizes)
          + "; the all-gather holds " + ", ".join(f"{extra[n]:.1f} kv more (N={n})" for n in sizes) + ".")
    print("Bytes rank 0 sent per forward + backward (our CommCounter), in units of its own k and v ('kv'), at every "
          "length:")
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        for n in sizes:
            sent = {method: [row[f"N={n} {dtype} {method}"]["sent"] for row in rows] for method in ("allgather",
                                                                                                  "alltoall")}
            units = {row[f"N={n} {dtype} alltoall"]["sent"] / row[f"N={n} {dtype} alltoall"]["kv_bytes"]
                     for row in rows}
            formula = [ring_attention_bytes(row["seq"], hidden, n, bytes_per_value=size) for row in rows]
            same = "the same" if sent["allgather"] == sent["alltoall"] else f"{sent['allgather']}"
            print(f"  {dtype:<8} N={n}: all-to-all {sent['alltoall']}, all-gather {same}; "
                  f"{' '.join(f'{u:.1f}' for u in sorted(units))} kv; formula {[round(f) for f in formula]}")
    for method in ("allgather", "alltoall"):
        print(f"CommDebugMode's count, {method}, N={sizes[-1]}, {last['seq']} tokens: "
              f"{last[f'N={sizes[-1]} float32 {method}']['debug_counts']}")
    return rows


def memory_figure(run: Any) -> Any:
    """Peak tensor bytes on rank 0 against the sequence length: one process, and a rank of torch's ring (float32) on
    2 and on 4 ranks."""
    import matplotlib.pyplot as plt

    got = run.results[0]
    rows = got["rows"]
    seqs = [row["seq"] for row in rows]
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=80, layout="constrained")
    ax.plot(seqs, [row["one process"]["peak"] / 2**20 for row in rows], "ko-", label="one process, whole sequence")
    for n, colour in zip(got["sizes"], ("tab:orange", "tab:blue"), strict=False):
        for method, style in (("alltoall", "^-"), ("allgather", "s--")):
            ax.plot(seqs, [row[f"N={n} float32 {method}"]["peak"] / 2**20 for row in rows], style, color=colour,
                    label=f"one rank of {n}, torch's ring, {method}")
    ax.set(xlabel="tokens in the sequence", ylabel="peak MiB in tensors", xscale="log", yscale="log",
           title="attention forward + backward, float32: peak tensor memory (MemTracker)")
    ax.set_xticks(seqs, [str(s) for s in seqs])
    ax.set_xticks([], minor=True)  # no log-scale minor labels ("2x10^2") beside the lengths
    ax.legend(fontsize=8)
    return fig


def token_all_to_alls(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The all-to-alls among `events` (CommCounter's) that carried token rows: float32 rows of the layer's width
    (DIM values), whatever else the layer called (its count exchange, by an all-to-all or another collective)."""
    return [e for e in events if e["op"] == "all_to_all" and sum(e.get("splits") or [])
            and e["bytes"] == sum(e["splits"]) * DIM * 4]


def _token_calls(checked: Checked | None, world_size: int, need: int) -> dict[int, list[dict[str, Any]]] | None:
    """Each rank's token all-to-alls in the forward of the MoE check run without a capacity, or None (with a line
    saying why) when the check has not passed or a rank made fewer than `need` of them."""
    if not checked:
        print("(no results yet: the MoE check has not passed)")
        return None
    calls = {rank: token_all_to_alls(got["None"]["forward"]) for rank, got in checked.results[world_size].items()}
    if min(len(c) for c in calls.values()) < need:
        print(f"(your layer's forward made {min(len(c) for c in calls.values())} all-to-all(s) of token rows "
              f"(float32 rows of {DIM} values) where this cell reads {need}: the rows went another way (an "
              "all-gather?), so there are no split sizes to show)")
        return None
    return calls


def moe_traffic(checked: Checked | None, world_size: int = 2) -> list[dict[str, Any]]:
    """The all-to-alls of token rows in one forward and backward of the MoE check run (no capacity), per rank: the
    bytes handed to each and the bytes that left the rank (from its split sizes). Other calls (the count exchange,
    whichever collective made it) are named in one line."""
    if not _token_calls(checked, world_size, need=1):
        return []
    rows = []
    print(f"{world_size} ranks, capacity factor None, all-to-alls of token rows ({DIM} float32 values each) in call "
          "order: the bytes of the tensor given to the call, and how many of them went to other ranks (the rest stays "
          "on this rank); splits: rows per rank")
    for rank, graded in sorted(checked.results[world_size].items()):
        got = graded["None"]
        calls = [("forward", e) for e in token_all_to_alls(got["forward"])] + [
            ("backward", e) for e in token_all_to_alls(got.get("backward", []))]
        others = [e for e in got["forward"] if e not in token_all_to_alls(got["forward"])]
        parts = [f"{phase} {e['bytes']} B given, {e['sent']} B to other ranks (splits {e['splits']})"
                 for phase, e in calls]
        parts += ["other calls in the forward: " + ", ".join(f"{e['op']} of {e['bytes']} B" for e in others)] \
            if others else []
        print(f"  rank {rank}: " + "\n          ".join(parts))
        rows.append({"rank": rank, "calls": calls, "others": others})
    return rows


def dispatch_figure(checked: Checked | None, world_size: int = 4) -> Any:
    """Rows sent from each rank to each rank by the dispatch all-to-all and back by the combine, from the run's split
    sizes (capacity factor None)."""
    token_calls = _token_calls(checked, world_size, need=2)  # the dispatch, then the combine
    if not token_calls:
        return None
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.6), dpi=80, layout="constrained")
    for ax, index, title in zip(axes, (0, 1), ("dispatch: token rows to the experts' ranks",
                                                "combine: results back to the tokens' ranks"), strict=True):
        matrix = [[token_calls[source][index]["splits"][dest] for dest in range(world_size)]
                  for source in range(world_size)]
        ax.imshow(matrix, cmap="Blues")
        for source in range(world_size):
            for dest in range(world_size):
                ax.text(dest, source, matrix[source][dest], ha="center", va="center", fontsize=10)
        ax.set(xlabel="to rank", ylabel="from rank", title=title, xticks=range(world_size), yticks=range(world_size))
    fig.suptitle(f"{world_size} ranks, 16 tokens each, top-2 of 4 experts (one expert per rank): rows per pair, "
                 "from the run's split sizes", fontsize=10)
    return fig


def routing_against_splits(checked: Checked | None, world_size: int = 2, trials: int = 20000) -> dict[str, Any]:
    """The dispatch all-to-all's split sizes in the MoE check run (capacity factor None) beside the rows the router
    sends, computed here from the same router and tokens: a layer that sends one row per (token, choice) pair must
    send from rank r to rank d the pairs whose expert lives on d (`per_choice`: every rank sent one row per pair; a
    layer that sends a token once per rank sends fewer), and the combine must send back what the dispatch carried
    (its matrix transposed, `back`). `rows_sent`: each rank's bytes to other ranks in the two. Then how many rows
    left each rank for the others, beside an even random router's spread (each token two different experts, all
    equally likely; `trials` draws in this process, seed 0): the middle 95 % of its counts."""
    from helpers.kit.context_experts import MOE_TOKENS, NUM_EXPERTS, TOP_K, build_moe, moe_tokens, route

    calls = _token_calls(checked, world_size, need=2)  # the dispatch, then the combine
    if not calls:
        return {}
    router, _ = build_moe()
    groups, _ = moe_tokens(world_size)
    local = NUM_EXPERTS // world_size
    with torch.no_grad():
        owners = [route(x, router)[0] // local for x in groups]
    routed = [[int((owner == dest).sum()) for dest in range(world_size)] for owner in owners]
    dispatch = [calls[rank][0]["splits"] for rank in range(world_size)]
    combine = [calls[rank][1]["splits"] for rank in range(world_size)]
    back = [[dispatch[source][rank] for source in range(world_size)] for rank in range(world_size)]  # retraced
    print(f"{world_size} ranks, rows from rank (row) to rank (column):\n  routed here, from the router: {routed}\n"
          f"  dispatch split sizes in the run: {dispatch}\n  combine split sizes in the run: {combine} (the "
          f"dispatch's, transposed: {back})")
    per_choice = all(sum(row) == MOE_TOKENS * TOP_K for row in dispatch)  # one row per (token, choice) pair
    if not per_choice:
        print(f"Your dispatch sent {[sum(row) for row in dispatch]} rows per rank, not one per (token, choice) pair "
              f"({MOE_TOKENS * TOP_K}): another design (a token sent once to a rank that owns both its experts?), so "
              "its split sizes need not equal the router's pairs.")
    rows_sent = [sum(e["sent"] for e in calls[rank][:2]) for rank in range(world_size)]
    generator = torch.Generator().manual_seed(0)
    draws = torch.rand(trials, MOE_TOKENS, NUM_EXPERTS, generator=generator).argsort(dim=-1)[..., :TOP_K]
    remote_even = ((draws // local) != 0).sum(dim=(1, 2)).float()  # rank 0's view; every rank's is the same
    low, high = (int(v) for v in torch.quantile(remote_even, torch.tensor([0.025, 0.975])))
    remote = [sum(n for dest, n in enumerate(row) if dest != rank) for rank, row in enumerate(routed)]
    inside = all(low <= n <= high for n in remote)
    print(f"Rows each rank sent to the others: {remote}, of {MOE_TOKENS * TOP_K}; an even random router sends "
          f"{remote_even.mean():.1f} on average, {low} to {high} in 95 % of {trials} draws: "
          + ("inside that spread, so 16 tokens cannot tell this router from an even one." if inside else
             "outside that spread: this router is uneven."))
    return {"routed": routed, "dispatch": dispatch, "combine": combine, "back": back, "remote": remote,
            "even": (low, high), "inside": inside, "per_choice": per_choice, "rows_sent": rows_sent}


def aux_loss_examples() -> dict[str, float]:
    """Switch's auxiliary loss (switch_aux_loss, 4 experts, top-2) for an even routing and for an uneven one: 60 tokens
    with probabilities [.26, .25, .25, .24] routed to experts 0 and 1, 40 with [0, 0, .5, .5] routed to 2 and 3 (a
    fresh reader's example): shares [.3, .3, .2, .2]."""
    from helpers.kit.context_experts import switch_aux_loss

    even = switch_aux_loss(torch.full((100, 4), 0.25), torch.tensor([[0, 1], [2, 3]] * 50), 4)
    probabilities = torch.tensor([[0.26, 0.25, 0.25, 0.24]] * 60 + [[0.0, 0.0, 0.5, 0.5]] * 40)
    chosen = torch.tensor([[0, 1]] * 60 + [[2, 3]] * 40)
    return {"even": float(even), "uneven": float(switch_aux_loss(probabilities, chosen, 4))}


def aux_loss_history(alpha: float, steps: int = 100, seed: int = 0) -> list[list[float]]:
    """Our toy run, in this process: a top-2 router over 4 experts that starts favouring expert 0 (1.5 added to its
    row), trained with Adam to fit a fixed random target, loss = MSE + alpha x Switch's auxiliary loss. Returns, per
    step, each expert's share of the assignments and the auxiliary loss."""
    from helpers.kit.context_experts import build_moe, route, switch_aux_loss

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread is fastest, and leaves the other core to the neighbours
    try:
        router, experts = build_moe()
        with torch.no_grad():
            router.weight[0] += 1.5
        generator = torch.Generator().manual_seed(seed)
        target = torch.nn.Linear(8, 8)
        optimizer = torch.optim.Adam([*router.parameters(), *experts.parameters()], lr=0.02)
        history = []
        for _ in range(steps):
            x = torch.randn(64, 8, generator=generator) + 1.0
            with torch.no_grad():
                wanted = torch.tanh(target(x))
            chosen, weights, probabilities = route(x, router)
            every = torch.stack([expert(x) for expert in experts], dim=1)  # all experts on every token: a toy
            out = (weights.unsqueeze(-1) * every.gather(1, chosen.unsqueeze(-1).expand(-1, -1, 8))).sum(dim=1)
            aux = switch_aux_loss(probabilities, chosen, len(experts))
            loss = (out - wanted).pow(2).mean() + alpha * aux
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            shares = torch.bincount(chosen.reshape(-1), minlength=len(experts)) / chosen.numel()
            history.append([*shares.tolist(), aux.item()])
        return history
    finally:
        torch.set_num_threads(threads)


def aux_figure(histories: dict[float, list[list[float]]]) -> Any:
    """Each expert's share of the assignments per step, one panel per alpha."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(histories), figsize=(5 * len(histories), 3.2), dpi=80, layout="constrained",
                             sharey=True)
    for ax, (alpha, history) in zip(axes, histories.items(), strict=True):
        for expert in range(len(history[0]) - 1):
            ax.plot([row[expert] for row in history], color=RANK_COLOURS[expert], label=f"expert {expert}")
        ax.axhline(1 / (len(history[0]) - 1), color="k", lw=0.6, ls="--")
        ax.set(xlabel="step", title=f"alpha = {alpha:g}: E·Σ f·P {history[0][-1]:.2f} -> {history[-1][-1]:.2f} "
                                    "(the loss: alpha times it)")
    axes[0].set_ylabel("share of the assignments")
    axes[-1].legend(fontsize=8)
    return fig


def closing_note(runs: dict, memory_rows: list[dict] | None = None) -> None:
    """The lesson's measured results in a few lines, from the runs kept by the checks and the memory run."""
    for key, what in (("ring", "ring attention"), ("causal", "causal ring attention")):
        checked = runs.get(key)
        if checked:
            truth = max(g["vs_truth"][n] for r in checked.results.values() for by_kind in r.values()
                        for g in by_kind.values() for n in ("out", "q", "k", "v"))
            theirs = max(g["vs_torch"][n] for r in checked.results.values() for by_kind in r.values()
                         for g in by_kind.values() for n in ("out", "q", "k", "v"))
            print(f"{what}: from one process max abs diff {truth:.1g} < {TRUTH:g}, from torch's ring max abs diff "
                  f"{theirs:.1g} < {TORCH:g} (2 and 4 ranks)")
    if runs.get("causal"):
        per_rank = runs["causal"].results[4]
        for kind in ("contiguous", "balanced"):
            blocks = [per_rank[r][kind]["forward"]["flops"] // per_rank[r][kind]["block_flops"]
                      for r in sorted(per_rank)]
            rows = per_rank[0][kind]["chunk_rows"]
            print(f"causal, 4 ranks, {kind}: score blocks per rank {blocks} (a block: {rows} queries x {rows} keys)")
    if memory_rows:
        row = memory_rows[-1]
        for dtype, rule in (("float32", "(3N - 2) x kv"), ("bfloat16", "(4N - 2) x kv, the gradients in float32")):
            ring = row[f"N=4 {dtype} alltoall"]
            print(f"ring bytes sent per rank, {row['seq']} tokens on 4 ranks, {dtype}: {ring['sent']} = "
                  f"{ring['sent'] / ring['kv_bytes']:g} x kv ({rule})")
    if runs.get("moe"):
        moe = runs["moe"].results
        worst = max(g[n] for r in moe.values() for by_factor in r.values() for g in by_factor.values()
                    for n in ("out", "x", "router", "experts"))
        dropped = {n: sum(sum(1 for row in g["1.0"]["kept"] for k in row if not k) for g in r.values())
                   for n, r in moe.items()}
        print(f"expert parallelism: from one process max abs diff {worst:.1g} < {TRUTH:g}; assignments dropped at "
              "capacity factor "
              f"1.0: {dropped[2]} on 2 ranks, {dropped[4]} on 4 ranks (the same as in one process)")
