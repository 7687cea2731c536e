"""Reports whether CUDA could still be initialised in this (possibly forked) worker."""
import torch

from helpers.kit.reporting import result

result(bad_fork=torch.cuda._is_in_bad_fork(), initialized=torch.cuda.is_initialized())
