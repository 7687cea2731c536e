"""One torchrun agent: PyTorch's own elastic launcher, driven from a launch spec.

The launcher runs this in a process of its own (forked from the preloaded launch server, or a fresh
``python -m helpers.launcher.agent spec.json``). The options are parsed by torchrun's own argument parser and
turned into a LaunchConfig by torchrun's own ``config_from_args``, so workers see exactly the
environment a terminal ``torchrun`` gives them. Only the entry point differs: workers start in
:mod:`helpers.launcher.bootstrap`, forked from this process (fast) or as fresh interpreters.

Writes the agent's result file into the run folder (helpers/kit/run_files.py): success, or every failed
rank with its exit code. Its own exit code is one of run_folder's AGENT_* codes.
"""
from __future__ import annotations

import json
import logging
import sys
import traceback

from helpers.launcher import run_folder


def _torchrun_argv(spec: dict) -> list[str]:
    argv = [f"--nproc-per-node={spec['nproc']}", f"--max-restarts={spec['max_restarts']}",
            f"--log-dir={spec['elastic_log_dir']}", "--redirects=3",
            f"--start-method={'spawn' if spec['fresh'] else 'fork'}",
            f"--shutdown-timeout={spec['stop_grace']}", f"--monitor-interval={spec['monitor_interval']}"]
    argv += spec["torchrun_argv"]
    return [*argv, spec["script"], *spec["args"]]


def _failures(error) -> dict:
    out = {}
    for rank, failure in error.failures.items():  # keyed by global rank
        out[str(rank)] = {"local_rank": failure.local_rank, "exitcode": failure.exitcode,
                                  "signal": failure.signal_name() if failure.exitcode < 0 else None,
                                  "message": failure.message, "timestamp": failure.timestamp}
    return out


def _config_without_touching_cuda(torchrun, args):
    """torchrun's LaunchConfig, built without asking for the accelerator count.

    LaunchConfig asks `torch.accelerator.device_count()` to pick default NUMA bindings. Counting CUDA
    devices registers a fork handler that poisons every process forked afterwards ("Cannot re-initialize
    CUDA in forked subprocess"), and our workers are forked from this process. A terminal torchrun does
    not care (it starts fresh interpreters); we give up only the default NUMA binding.
    """
    import torch

    really_available = torch.accelerator.is_available
    torch.accelerator.is_available = lambda: False
    try:
        config, _, _ = torchrun.config_from_args(args)
    finally:
        torch.accelerator.is_available = really_available
    return config


def run_agent(spec: dict) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from helpers.launcher.bootstrap import run_forked_script

    # Elastic logs each failed worker with logger.exception, whose formatting takes ~3 s here
    # (it walks and imports modules); the launcher reports failures from its own records instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    result_path = run_folder.node_file(spec["run_dir"], "agent_result", spec["node_rank"])
    args = torchrun.get_args_parser().parse_args(_torchrun_argv(spec))
    config = _config_without_touching_cuda(torchrun, args)
    script_and_args = [spec["script"], *spec["args"]]
    if spec["fresh"]:
        entrypoint, entry_args = sys.executable, ["-u", "-m", "helpers.launcher.bootstrap", *script_and_args]
    else:
        entrypoint, entry_args = run_forked_script, script_and_args
    try:
        elastic_launch(config, entrypoint)(*entry_args)
        outcome, code = {"ok": True}, run_folder.AGENT_OK
    except ChildFailedError as error:
        outcome, code = {"ok": False, "failures": _failures(error)}, run_folder.AGENT_WORKERS_FAILED
    except Exception:
        outcome, code = {"ok": False, "agent_error": traceback.format_exc()}, run_folder.AGENT_ERROR
    run_folder.write_json(result_path, outcome)
    return code


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    from helpers.launcher.bootstrap import die_with_parent

    die_with_parent()
    sys.exit(run_agent(spec))


if __name__ == "__main__":
    main()
