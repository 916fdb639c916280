"""Run a step script with float64 as PyTorch's default floating-point type.

    python benchmarks/float64.py 01_cifar10_cpu.py --synthetic --norm group
    torchrun --standalone --nproc_per_node=2 benchmarks/float64.py 04_cifar10_ddp.py --synthetic --norm group

The step's weights (common/models.py) and images (common/data.py) are then float64. In float32,
two runs that sum the same gradients in a different order differ by rounding, and ReLU and
max-pooling amplify that chaotically within a few steps; in float64 what remains of a difference
is a difference in what the runs compute. benchmarks/parity.py uses this; so can a reader who
wants to check their own change. 05 runs only with ZeRO-1 or 2 (DeepSpeed's ZeRO-0 and 3 refuse to
reduce float64 gradients), which all-reduce them in fp32 (DeepSpeed's default communication_data_type),
and its optimizer still updates fp32 master weights.
"""

import sys

import torch
from launch import run_step_here

if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    run_step_here(sys.argv[1:])
