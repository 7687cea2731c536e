"""Library code for lesson 02 (DistributedDataParallel), used by its workers and its notebook.

    from helpers.kit.tensors import flat, parameter_checksum
    from helpers.lessons.ddp import single_process_reference
    from helpers.kit.ddp import article_source
    from helpers.lessons.ddp import check_ddp_worker, last_error_line, undefined_names

Taught in notebooks/02_ddp.ipynb: checksums prove the ranks hold identical weights, the single-
process reference proves DDP's averaged gradients equal one big batch's, and the article helpers
run the source article's tutorial with some of its bugs fixed to show where it breaks.
"""
from __future__ import annotations

import ast
import builtins
import difflib
import functools
import html
import re
from pathlib import Path

import torch
from torch import nn

from helpers.kit.tensors import flat, max_abs_diff, parameter_checksum
from helpers.kit.timing import NOT_DISTINGUISHABLE, Timing, Verdict, verdict
from helpers.lessons.checks import announce_run, correct, each_rank, not_yet, not_yet_crashed


def single_process_reference(global_batch: int, steps: int, lr: float = 0.1, seed: int = 0) -> dict:
    """What one process computes on the same global batches as ddp_equivalence.py.

    Returns the first step's gradient and the weights after `steps` plain SGD steps.
    """
    from helpers.kit.data import load
    from helpers.kit.models import build_model

    train_set, _ = load(train=True, limit=global_batch * steps)
    torch.manual_seed(seed)
    model = build_model("simple")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    first_gradient = None
    for images, labels in torch.utils.data.DataLoader(train_set, batch_size=global_batch):
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        if first_gradient is None:
            first_gradient = flat([p.grad for p in model.parameters()])
        optimizer.step()
    return {"first_gradient": first_gradient, "final_weights": flat(list(model.parameters())),
            "checksum": parameter_checksum(model)}


# ---------------------------------------------------------------- showing scripts


def script_lines(path: Path) -> list[str]:
    """A script's lines after its module docstring."""
    text = Path(path).read_text()
    return text[text.index('"""', 3) + 3:].lstrip().splitlines(keepends=True)


def coloured_diff(old: Path, new: Path, context: int = 1, fold_before: str | None = None, fold_summary: str = ""):
    """A unified diff of two scripts (without their docstrings) as HTML: removed lines red, added lines green.
    fold_before: the hunks before the first one that contains this text go into a closed fold after the others,
    with fold_summary as its title (so that the lines that matter are what a reader sees first)."""
    from IPython.display import HTML

    colours = {"-": "#ffebe9", "+": "#dafbe1", "@": "#ddf4ff"}
    hunks: list[list[str]] = []
    for line in difflib.unified_diff(script_lines(old), script_lines(new), Path(old).name, Path(new).name,
                                     n=context):
        line = line.rstrip("\n")
        if line.startswith("@@") or not hunks:
            hunks.append([])
        colour = "#eeeeee" if line.startswith(("---", "+++")) else colours.get(line[:1])
        style = f" style='background:{colour}'" if colour else ""
        hunks[-1].append(f"<div{style}>{html.escape(line) or '&nbsp;'}</div>")
    first = next((i for i, hunk in enumerate(hunks) if fold_before and any(html.escape(fold_before) in row
                                                                          for row in hunk)), 1)
    shown, folded = hunks[:1] + hunks[first:], hunks[1:first]

    def pre(parts: list[list[str]]) -> str:
        rows = "".join(row for hunk in parts for row in hunk)
        return f"<pre style='font-size:12px;line-height:1.3'>{rows}</pre>"
    rest = (f"<details><summary>{html.escape(fold_summary)} ({sum(len(h) for h in folded)} lines of the diff)"
            f"</summary>{pre(folded)}</details>") if folded else ""
    return HTML(pre(shown) + rest)


# ---------------------------------------------------------------- the article's tutorial, as printed


def undefined_names(source: str) -> list[str]:
    """Names a module reads but never imports, defines or assigns (what `import os` would fix)."""
    tree = ast.parse(source)
    defined = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            defined |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.arg):
            defined.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            defined.add(node.id)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return sorted(used - defined)


def last_error_line(text: str) -> str:
    """The final 'SomeError: message' line of a traceback, without machine paths."""
    lines = [line.strip() for line in str(text).splitlines() if re.match(r"^\s*[\w.]+(Error|Exception)\b", line)]
    line = lines[-1] if lines else str(text).strip().splitlines()[-1]
    return re.sub(r"(from )?'?/[^\s'>]*'?", "", line).replace(" >", ">").strip()


# ---------------------------------------------------------------- pictures and runs of the lesson


def plot_ddp_gradients(alone: dict[int, dict], ddp: dict[int, dict], count: int = 16):
    """The first step's gradient, last `count` values (the output layer's), of each rank training alone on its own
    share, and of each rank under DDP: DDP's is the mean of the ranks' own (ddp_equivalence.py's results)."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(8, 3.2), dpi=80, layout="constrained")
    positions = range(count)
    for rank, marker in ((0, "v"), (1, "^")):
        ax.plot(positions, alone[rank]["first_gradient"][-count:], marker, color=f"C{rank}", alpha=0.8,
                label=f"rank {rank} alone: the gradient of its own 16 samples")
    for rank, style in ((0, {"s": 90, "facecolors": "none", "edgecolors": "k"}), (1, {"s": 18, "color": "k"})):
        ax.scatter(positions, ddp[rank]["first_gradient"][-count:], label=f"rank {rank} under DDP", **style)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set(xlabel=f"the last {count} gradient values (the output layer)", ylabel="gradient",
           title="After DDP's backward every rank holds the mean of the ranks' own gradients")
    ax.legend(fontsize="small", ncol=2)
    return ax


def _run_together(commands: dict[str, list[str]], timeout: float, say_every: float = 4.0) -> dict[str, str]:
    """Run these commands at the same time (this repository on PYTHONPATH); print progress while they run; return
    each one's stdout and stderr together."""
    import os
    import subprocess
    import sys
    import time

    from helpers.kit import REPO_ROOT

    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    running = {name: subprocess.Popen([sys.executable, *command], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, env=env) for name, command in commands.items()}
    started = next_word = time.monotonic()
    while any(process.poll() is None for process in running.values()):
        if time.monotonic() - started > timeout:
            for process in running.values():
                process.kill()
            raise TimeoutError(f"still running after {timeout:g} s: {', '.join(commands)}")
        if time.monotonic() >= next_word + say_every:
            next_word = time.monotonic()
            print(f"  ... {next_word - started:.0f} s", flush=True)
        time.sleep(0.2)
    return {name: process.communicate()[0] for name, process in running.items()}


def fork_probe() -> dict[str, dict]:
    """For each question the parent asked before it forked (three processes of ddp_fork_probe.py at once): the
    child's line ("said"), and whether NVML could count the GPUs on this machine ("nvml_counted"), which decides
    whether device_count() poisoned the fork."""
    from helpers.kit import WORKERS

    questions = ("nothing", "is_available", "device_count")
    said = _run_together({q: [str(WORKERS / "ddp_fork_probe.py"), q] for q in questions}, timeout=120)
    found = {}
    for question in questions:
        lines = said[question].strip().splitlines()
        child = next(line for line in lines if line.startswith("child: "))
        found[question] = {"said": child, "nvml_counted": "nvml counted: yes" in lines}
    return found


def torchrun_failure_reports(attempts: int = 3) -> dict[str, str]:
    """Run ddp_failure_report.py under torchrun on 2 processes, without and then with --record, with this kernel's
    launch server stopped first (both at once, six fresh interpreters beside the kernel and the server, took 2.9 GiB
    on 6 December; one at a time beside the server 2.0 GiB); return what each printed (stdout and stderr).

    A rank that dies of SIGABRT while Python tears down its gloo process group makes torchrun's report name the
    signal as its exit (without @record, only the signal; with it, the traceback beside it). When rank 1 raised at
    step 2, right after an all_reduce, that happened in 9 launches of 32 on a busy 2-core machine here (gloo's thread
    released that collective's tensor after Python had begun shutting down); now that it raises at step 0, before
    any collective of its own, it happened in none of 32. Should it happen, the pair runs again, up to `attempts`
    times in all, so that the lesson shows the report of a plain error."""
    from helpers.kit import WORKERS
    from helpers.launcher.api import stop_launch_server

    stop_launch_server(before="torchrun's fresh interpreters")
    command = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(WORKERS / "ddp_failure_report.py")]
    commands = {"without @record": command, "with @record": [*command, "--record"]}
    for attempt in range(1, attempts + 1):
        outputs = {name: _run_together({name: one}, timeout=240)[name] for name, one in commands.items()}
        if not any("SIGABRT" in output for output in outputs.values()):
            break
        if attempt < attempts:
            print("(A rank died of SIGABRT in gloo's teardown, so a report names the signal, not the error: running "
                  "the pair again.)", flush=True)
    return outputs


def failure_report(output: str) -> str:
    """torchrun's ChildFailedError report from a run's output, from its first line to its closing border (a rank's
    own output can still arrive after it), without what changes from run to run (times, host, process ids,
    temporary paths, ports) and with torch's own frames shortened to their file names."""
    report = output[output.index("torch.distributed.elastic.multiprocessing.errors.ChildFailedError"):]
    border = report.find("\n=", report.index("Root Cause (first observed failure)"))  # the closing border
    if border >= 0:  # a rank's own output, which torchrun copies line by line, can still arrive after it
        line_end = report.find("\n", border + 1)
        report = report[:line_end if line_end >= 0 else len(report)]
    report = "\n".join(line for line in report.splitlines() if not re.match(r"\[(?:rank|default)\d*\]:", line))
    report = re.sub(r"(time\s+: ).*", r"\1<time>", report)
    report = re.sub(r"(host\s+: ).*", r"\1<host>", report)
    report = re.sub(r"\(pid: \d+\)", "(pid: <pid>)", report)
    report = re.sub(r"PID \d+", "PID <pid>", report)
    report = re.sub(r"/\S*/torchelastic_\S*/attempt_", "<torchrun's temporary folder>/attempt_", report)
    report = re.sub(r"\[[\d.]+\]:\d+", "[127.0.0.1]:<port>", report)
    report = re.sub(r'File "\S*/(torch/\S+|helpers/\S+)"', r'File "\1"', report)
    report = re.sub(r"^/\S*/(helpers/\S+ FAILED)", r"\1", report, flags=re.M)
    return re.sub(r"\[/\S+/third_party/", "[third_party/", report).strip()


# ---------------------------------------------------------------- one rank or two, timed by the protocol


def step_settings(model: str, world_size: int = 2, global_batch: int = 64) -> dict[str, str]:
    """ddp_step_time.py's setting names for one model, by role."""
    return {"ddp": f"{model}, DDP, {world_size} ranks", "python_hook": f"{model}, DDP, Python all-reduce hook",
            "quiet": f"{model}, DDP, no all-reduce", "bare": f"{model}, all-reduce alone",
            "half": f"{model}, 1 rank, batch {global_batch // world_size}", "one": f"{model}, 1 rank, 1 thread",
            "two_threads": f"{model}, 1 rank, 2 threads"}


def said(found: Verdict, prefix: str = "") -> str:
    """A verdict in a few words: which is faster (wall time) or uses less CPU time (CPU time), and by how much, or
    "not distinguishable on this machine"; `prefix` (a model's name and comma, say) is left out of the setting's
    name."""
    if not found.distinguishable:
        return NOT_DISTINGUISHABLE
    how = "uses less CPU time" if " uses less CPU time than " in found.sentence else "is faster"
    return f"{found.faster.removeprefix(prefix)} {how}, {found.ratio:.2f}x"


def print_timings(timings: dict[str, Timing], prefix: str = "", indent: str = "  ") -> None:
    """One line per setting: the median and spread of its rounds, wall time and CPU time."""
    width = max(len(name.removeprefix(prefix)) for name in timings)
    for name, timing in timings.items():
        print(f"{indent}{name.removeprefix(prefix):<{width}}  wall {timing.summary():<24} CPU {timing.summary('cpu')}")


def read_step_times(timings: dict[str, Timing], parameters: dict[str, int]) -> dict[str, dict[str, Verdict]]:
    """Print ddp_step_time.py's timings per model (median and spread of the rounds, wall and CPU time) and the
    verdicts of the comparisons that matter; return the verdicts, by model and question.
    The questions: is DDP on 2 ranks faster than 1 process (wall)? are 2 threads faster than 1, and do they use more
    CPU time? what does the all-reduce cost (a Python hook that all-reduces against one that sends nothing, wall and
    CPU)? what does the Python hook cost (DDP's built-in hook against it)? what do 2 processes cost (no all-reduce
    against 1 rank at the per-rank batch, wall)? is the all-reduce alone as slow as one rank's whole step (wall)?"""
    verdicts = {}
    for model, title in (("simple", "the article's model"), ("cnn", "the CNN")):
        names = step_settings(model)
        print(f"{title} ({parameters[model]:,} gradients to all-reduce per step), per step, median of "
              f"{len(timings[names['one']].wall)} rounds (lowest-highest):")
        print_timings({name: timings[name] for name in names.values()}, prefix=f"{model}, ")
        pairs = {"ddp": ("ddp", "one", "wall"), "threads": ("two_threads", "one", "wall"),
                 "threads cpu": ("two_threads", "one", "cpu"), "all-reduce": ("python_hook", "quiet", "wall"),
                 "all-reduce cpu": ("python_hook", "quiet", "cpu"), "hook": ("ddp", "python_hook", "wall"),
                 "hook cpu": ("ddp", "python_hook", "cpu"), "processes": ("quiet", "half", "wall"),
                 "communicating": ("bare", "one", "wall")}
        found = {key: verdict(timings[names[first]], timings[names[second]], kind=kind)
                 for key, (first, second, kind) in pairs.items()}
        short = {key: said(value, f"{model}, ") for key, value in found.items()}
        print(f"  DDP on 2 ranks against 1 rank, 1 thread (wall): {short['ddp']}\n"
              f"  2 threads against 1 thread, one process: wall: {short['threads']}; CPU: {short['threads cpu']}\n"
              f"  the all-reduce's cost, Python all-reduce hook against no all-reduce: wall: {short['all-reduce']}; "
              f"CPU: {short['all-reduce cpu']}\n"
              f"  the Python hook's cost, DDP's built-in hook against it: wall: {short['hook']}; "
              f"CPU: {short['hook cpu']}\n"
              f"  2 processes' cost, no all-reduce against 1 rank at batch 32 (wall): {short['processes']}\n"
              f"  communicating against computing, all-reduce alone against 1 rank's whole step (wall): "
              f"{short['communicating']}")
        verdicts[model] = found
    return verdicts


# ---------------------------------------------------------------- the exercise


def _one_process_reference() -> dict:
    """The starting script's result on one process, computed here in the notebook's process (the same training
    as ddp_exercise_single.py, written out in _one_process_variant). Not a launch of that file: a learner may have
    edited it, and the check must not depend on a file the learner can change. tests/test_ddp.py checks that
    this equals a launch of the untouched file."""
    from helpers.kit.data import load

    train_set, _ = load(train=True, limit=256)
    return {"weights": _one_process_variant(), "samples_seen": len(train_set)}


@functools.cache
def _one_process_variant(batch: int = 32, lr: float = 0.1, shuffled: bool = False) -> torch.Tensor:
    """ddp_exercise_single.py's training, computed here in one process, with one thing changed: what a 2-rank
    DDP run with a typical mistake computes. `shuffled`: DistributedSampler's default shuffle=True at epoch 0,
    whose order is torch.randperm with a generator seeded 0 + epoch (torch/utils/data/distributed.py:111-112);
    rank r takes every second index from r (:134), so the two ranks' batches k together hold positions
    32k..32k+31 of that order."""
    from helpers.kit.data import load
    from helpers.kit.models import build_model

    train_set, _ = load(train=True, limit=256)
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(0)).tolist() if shuffled \
        else list(range(len(train_set)))
    torch.manual_seed(0)
    model = build_model("simple")
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    for start in range(0, len(order), batch):
        images, labels = train_set[order[start:start + batch]]
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return flat(list(model.parameters()))


def _which_mistake(weights: torch.Tensor) -> str | None:
    """The advice for the first one-process variant that `weights` match (2 ranks only), else None."""
    variants = (
        ({"batch": 64}, "each rank used a batch of GLOBAL_BATCH, so every step averaged 64 samples: use a per-rank "
                        "batch of GLOBAL_BATCH // world_size."),
        ({"shuffled": True}, "the ranks took the samples in DistributedSampler's default shuffled order: pass "
                             "DistributedSampler(..., shuffle=False)."),
        ({"lr": 0.2}, "every step was twice as large, as if the gradients were summed over the ranks and not "
                      "averaged: divide the all_reduce's sum by world_size."),
    )
    for change, advice in variants:
        if max_abs_diff(weights, _one_process_variant(**change)) < 1e-5:
            return advice
    return None


def check_ddp_worker(script: str | Path, nproc: int = 2, timeout: float = 60) -> bool:
    """Launch the learner's DDP version of ddp_exercise_single.py on `nproc` ranks; say what is still missing.

    Prints one line, "Correct: ..." or "Not yet: ...". The untouched starting script gets "Not yet":
    on 2 ranks it runs twice, each copy on all the data. Both ways of averaging pass: DDP, or all_reduce
    of every gradient by hand (ddp_exercise_solution.py, ddp_exercise_by_hand_solution.py). Each rank's .grad
    after the last step tells the gradients' average (equal on every rank) from the weights' average (equal
    weights from each rank's own gradients: the same end with plain SGD, not in general) and from a missing
    common start (equal gradients, different weights).
    """
    from helpers.launcher.api import LaunchTimeout, WorkerFailed, launch

    script = Path(script)
    if not script.is_file():
        return not_yet(f"{script} does not exist yet: write your DDP worker there first.")
    reference = _one_process_reference()
    announce_run(script.name, nproc, timeout, stop_after=min(15, timeout))
    try:
        run = launch(script, nproc=nproc, echo=False, timeout=timeout)
    except LaunchTimeout as error:
        folder = f" Each rank's output is in {error.run.log_dir}/rank<N>.log." if error.run is not None else ""
        return not_yet(f"your script was still running after {timeout:g} s. A collective that not every rank "
                       f"calls (say, all_reduce or broadcast inside `if rank == 0:`) waits for the others until the "
                       f"process group's timeout. Next time, press Stop (■) as soon as it seems stuck: the launcher "
                       f"says the same at once. Where each rank was:{each_rank(error.where)}{folder}")
    except WorkerFailed as error:
        if error.rank is not None and error.error is None:  # no rank raised: one left while another still waited
            folder = f" Each rank's output is in {error.run.log_dir}/rank<N>.log." if error.run is not None else ""
            return not_yet(f"your script failed on {nproc} ranks: {str(error).strip().splitlines()[0]} A rank that "
                           "finishes while another still waits in a collective ends like this on gloo: every rank "
                           "must call the same collectives in the same order (is one inside `if rank == 0:`?)."
                           + folder)
        return not_yet_crashed(error, "your script")
    missing = any({"weights", "gradients"} - set(r) for r in run.results.values())
    if sorted(run.results) != list(range(nproc)) or missing:
        return not_yet("every rank must call result(weights=..., gradients=..., samples_seen=...) as the original "
                       "script does.")
    seen = [run.results[rank]["samples_seen"] for rank in range(nproc)]
    total, share = reference["samples_seen"], reference["samples_seen"] // nproc
    if seen != [share] * nproc:  # the unchanged script: every rank trains on all the data
        return not_yet(f"the ranks trained on {seen} samples; each should train on its own {share} of the "
                       f"{total}: give each rank its share with DistributedSampler.")
    empty = [rank for rank in range(nproc) if any(g is None for g in run.results[rank]["gradients"])]
    if empty:  # .grad is None when result() reads it: zero_grad() moved after the step
        return not_yet(f"on rank {empty[0]} a parameter's .grad was None when result(...) read it: keep "
                       f"optimizer.zero_grad() before loss.backward(), as the original does, so that .grad still holds "
                       f"the last step's gradient at the end.")
    gradients = {rank: flat([torch.tensor(g) for g in run.results[rank]["gradients"]]) for rank in range(nproc)}
    rank_diff = max(max_abs_diff(run.results[r]["weights"], run.results[0]["weights"]) for r in range(nproc))
    gradient_diff = max(max_abs_diff(gradients[r], gradients[0]) for r in range(nproc))
    if gradient_diff > 1e-6 and rank_diff != 0:  # sharded but not synchronised: each rank learns from its half only
        return not_yet(f"the ranks end with different weights (max abs diff {rank_diff:.1e}): wrap the model in "
                       f"DistributedDataParallel so that every step averages the gradients (or, by hand: after "
                       f"backward(), all_reduce every parameter's .grad and divide it by world_size).")
    if gradient_diff > 1e-6:  # equal weights from different gradients: something else was averaged after the step
        return not_yet(f"the ranks end with equal weights, but after the last step each rank's .grad is still its "
                       f"own (the ranks' gradients differ by up to {gradient_diff:.1e}): the ranks averaged something "
                       f"after optimizer.step(), the weights perhaps, not the gradients before it. With plain SGD "
                       f"that ends in the same weights, because SGD's step is linear in the gradient; with an "
                       f"optimizer that is not (Adam, or gradient clipping) it does not. Average the gradients before "
                       f"optimizer.step(): wrap the model in DistributedDataParallel, or all_reduce every .grad after "
                       f"backward() and divide it by world_size.")
    if rank_diff != 0:  # the same averaged gradients applied to different weights: no common start
        return not_yet(f"the ranks averaged their gradients (every rank's .grad is the same), but they end with "
                       f"different weights (max abs diff {rank_diff:.1e}): they started from different weights. Start "
                       f"every rank from rank 0's weights: dist.broadcast(parameter.data, src=0) for every parameter "
                       f"before training, as DDP does when it wraps the model. (Did you seed each rank differently?)")
    diff = max_abs_diff(run.results[0]["weights"], reference["weights"])
    advice = _which_mistake(run.results[0]["weights"]) if diff >= 1e-5 and nproc == 2 else None
    if advice:  # the weights match one process making one of the usual mistakes
        return not_yet(f"the ranks agree, but their weights differ from the one-process run (max abs diff "
                       f"{diff:.1e}), and they match what one process computes with this mistake: {advice}")
    if diff >= 1e-5:  # e.g. a per-rank batch of GLOBAL_BATCH, or shuffled shards
        return not_yet(f"the ranks agree, but their weights differ from the one-process run (max abs diff "
                       f"{diff:.1e}): use a per-rank batch of GLOBAL_BATCH // world_size and deal the samples in turn, "
                       f"as DistributedSampler(shuffle=False) does (rank r takes samples r, r + world_size, ...), so "
                       f"that each global batch holds the same samples as in one process (contiguous halves, rank 0 "
                       f"taking the first half, put other samples in each step); averaging by hand, divide the "
                       f"all_reduce's sum by world_size.")
    printed = {rank: text.strip().splitlines() for rank, text in run.logs.items() if rank != 0 and text.strip()}
    if printed:  # e.g. the original print() left outside `if rank == 0:`: every rank prints the same line
        rank, lines = min(printed.items())
        return not_yet(f"the training is right, but rank {rank} printed too ({lines[0]!r}): print only on rank 0 "
                       f"(inside `if rank == 0:`), so that the output shows each line once.")
    return correct(f"each of {nproc} ranks trained on its own {share} of the {total} samples, the ranks end with "
                   f"identical weights, and those equal the one-process run (max abs diff below 1e-05).")
