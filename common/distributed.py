"""Small distributed helpers. Each is also correct in a single process (world size 1)."""

import os

import torch.distributed as dist


def is_main_process():
    """Rank 0, also before the process group exists (launchers set RANK in the environment)."""
    if dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def print0(*args, **kwargs):
    """`print` on rank 0 only, so that N processes do not print every line N times."""
    if is_main_process():
        print(*args, **kwargs, flush=True)


def all_reduce_mean(value):
    """The mean of a scalar tensor over all ranks (for logging: every rank must call it)."""
    if not dist.is_initialized():
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()

