"""Each worker reports who torchrun says it is: the environment every distributed script starts from.

    torchrun --standalone --nproc-per-node 2 helpers/workers/whoami.py
    # two "nodes" on one machine (run both commands, in two terminals):
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 helpers/workers/whoami.py
    torchrun --nnodes 2 --node-rank 1 --nproc-per-node 2 --rdzv-endpoint 127.0.0.1:29400 helpers/workers/whoami.py
"""
import os

from helpers.worker import result

NAMES = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"]


def main() -> None:
    me = {name: os.environ[name] for name in NAMES}
    print(" ".join(f"{name}={value}" for name, value in me.items() if name != "MASTER_PORT"))
    result(**me, HELPERS_NODE=os.environ.get("HELPERS_NODE", me["GROUP_RANK"]))


if __name__ == "__main__":
    main()
