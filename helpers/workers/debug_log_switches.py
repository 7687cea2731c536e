"""What torch's and NCCL's log switches add: one process, a gloo group of one, and an error from c10d's C++ code.

    TORCH_CPP_LOG_LEVEL=INFO TORCH_SHOW_CPP_STACKTRACES=1 NCCL_DEBUG=INFO python helpers/workers/debug_log_switches.py

All three are read when a library starts, so they must be in the environment before Python starts:
  TORCH_CPP_LOG_LEVEL=INFO        torch's C++ code logs at INFO (default WARNING): c10d's store and socket set-up
  TORCH_SHOW_CPP_STACKTRACES=1    an error raised in torch's C++ code carries its C++ stack
  NCCL_DEBUG=INFO                 read by NCCL alone: with gloo, nothing is printed
"""
import torch
import torch.distributed as dist


def main() -> None:
    store = dist.TCPStore("127.0.0.1", 0, world_size=1, is_master=True)  # port 0: any free port
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    dist.broadcast(torch.ones(1), src=3)  # the planted error: there is no rank 3 (c10d's C++ check raises)


if __name__ == "__main__":
    main()
