"""Run a step without deterministic GPU kernels: PyTorch's fastest kernels, reproducible or not.

    python benchmarks/nondeterministic.py 02_cifar10_gpu.py --synthetic --amp bf16
    torchrun --standalone --nproc_per_node=N benchmarks/nondeterministic.py 04_cifar10_ddp.py --synthetic

On a GPU every step calls `utils.use_deterministic_kernels()` (common/utils.py), so that two runs of
one seed, or a run stopped and resumed, end with the same weights. Here that switch does nothing:
`benchmarks/throughput.py --nondeterministic` uses this to measure what determinism costs. A run made
this way does not resume exactly on a GPU.
"""

import sys

import torch
from launch import run_step_here

if __name__ == "__main__":
    torch.use_deterministic_algorithms = lambda mode, **options: None
    run_step_here(sys.argv[1:])
