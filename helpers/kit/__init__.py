"""The worker kit: what a worker script may import (the standard library and torch, nothing else of helpers).

    from helpers.kit.reporting import report, progress, result     # back to the notebook; no-ops under torchrun
    from helpers.kit.distributed import init_distributed            # join the process group (gloo or nccl)

Shared by many lessons: ``reporting``, ``run_files`` (the run folder's file names, which the launcher reads back),
``live_wire`` (the messages between a notebook kernel and its live ranks, %ranks),
``distributed``, ``models``, ``data``, ``tensors`` (checksums, flat vectors, bytes), ``instruments`` (counting hooks,
stopwatches, cross-rank checks), ``checkpoint``, ``transformer`` (lessons 10-11). One module per lesson that needs
worker-side code, named like its notebook-side sibling in ``helpers/lessons/``: ``ddp`` (02), ``dp_vs_ddp`` (03),
``rpc`` (05), ``debugging`` (08), ``zero`` (09), ``scale`` (11). Importing this package costs nothing.
"""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
WORKERS = REPO_ROOT / "helpers" / "workers"
