"""Rank 0 fails on the first attempt only; torchrun restarts the group and it succeeds."""
import os

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"attempt {attempt} rank {os.environ['RANK']}")
if attempt == 0 and os.environ["RANK"] == "0":
    raise SystemExit(3)
