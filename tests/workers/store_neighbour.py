"""A job whose rank 0 keeps a value in torchrun's store, tells where the store is, and watches for a stranger's key.

    torchrun --standalone --nproc-per-node 2 tests/workers/store_neighbour.py --port-file /tmp/port --wait 20

Rank 0 connects to the store torchrun's agent serves (MASTER_ADDR:MASTER_PORT, a TCPStore: no authentication,
see PyTorch's SECURITY.md, "Using distributed features"), sets lesson/secret, writes the port to --port-file, then
waits up to --wait seconds for a key lesson/intruder that only a process outside the job could set. With
--hold-until FILE it then stays alive until FILE exists (at most a minute), so a test knows the job was up.
"""
import argparse
import os
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from helpers.kit.reporting import result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port-file", required=True)
    parser.add_argument("--wait", type=float, default=20.0)
    parser.add_argument("--hold-until", default="")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    if dist.get_rank() == 0:
        port = int(os.environ["MASTER_PORT"])
        store = dist.TCPStore(os.environ["MASTER_ADDR"], port, is_master=False, timeout=timedelta(seconds=30))
        store.set("lesson/secret", "rank 0's value")
        Path(args.port_file).write_text(str(port))
        try:
            store.wait(["lesson/intruder"], timedelta(seconds=args.wait))
            intruder = store.get("lesson/intruder").decode()
        except RuntimeError:  # DistStoreError (a RuntimeError) on timeout: nobody from outside reached us
            intruder = None
        deadline = time.monotonic() + 60
        while args.hold_until and not Path(args.hold_until).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        result(port=port, intruder=intruder)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
