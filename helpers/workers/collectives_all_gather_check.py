"""Lesson 01's check harness: run the learner's all_gather script, then hand back the collectives torch recorded.

    torchrun --standalone --nproc-per-node 3 helpers/workers/collectives_all_gather_check.py notebooks/my_all_gather.py

Runs FILE as __main__, as `python FILE` would (it hands back result(gathered=...) itself), then hands back
result(collectives=[...]): the operations torch's flight recorder logged on this rank, named as the backend names
them ("gloo:all_gather", "gloo:barrier"). The recorder is on by default (TORCH_FR_BUFFER_SIZE, 2000 entries) and
outlives destroy_process_group; gloo logs its collectives there, not its send/recv. So helpers/lessons/collectives.py
can refuse a collective however the script reached it (getattr included). Works with one process.

It hides the GPUs first (CUDA_VISIBLE_DEVICES empty, before anything asks CUDA for its devices), so the learner's
init_distributed() joins gloo with CPU tensors on every machine: separate isend/irecv calls can hang on nccl
(lesson 01).
"""
import json
import os
import runpy
import sys
from pathlib import Path

from torch._C._distributed_c10d import _dump_fr_trace_json

from helpers.kit.reporting import result


def main() -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo and the CPU on every machine (the docstring says why)
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))  # as `python FILE` would: the script's folder first
    runpy.run_path(str(script), run_name="__main__")
    entries = json.loads(_dump_fr_trace_json()).get("entries", [])
    result(collectives=[entry.get("profiling_name", "") for entry in entries])


if __name__ == "__main__":
    main()
