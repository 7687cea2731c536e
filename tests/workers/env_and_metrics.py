"""Reports torchrun's environment and a few metrics, progress and results."""
import os

from helpers.kit.reporting import progress, report, result

names = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "TORCHELASTIC_RUN_ID", "GROUP_RANK"]
rank = int(os.environ["RANK"])
for step in range(5):
    report(step=step, loss=1.0 / (step + 1 + rank), lr=0.1)
    progress(step + 1, total=5)
result(env={name: os.environ.get(name) for name in names}, square=rank * rank)
