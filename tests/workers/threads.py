"""Reports the threads torch uses in this worker, and OMP_NUM_THREADS."""
import os

import torch

from helpers.kit.reporting import result

result(omp=os.environ.get("OMP_NUM_THREADS"), torch_threads=torch.get_num_threads())
