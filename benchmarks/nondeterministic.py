"""Run a step without deterministic algorithms: PyTorch's fastest kernels, reproducible or not.

    python benchmarks/nondeterministic.py 02_cifar10_gpu.py --synthetic --amp bf16
    torchrun --nproc_per_node=N benchmarks/nondeterministic.py 04_cifar10_ddp.py --synthetic

Every step turns on `torch.use_deterministic_algorithms` (common/utils.py, `seed_everything`), so
that on a GPU two runs of one seed, or a run stopped and resumed, end with the same weights. Here
that call does nothing: `benchmarks/throughput.py --nondeterministic` uses this to measure what the
determinism costs. A run made this way does not resume exactly on a GPU.
"""

import os
import runpy
import sys

import torch

if __name__ == "__main__":
    torch.use_deterministic_algorithms = lambda mode, **options: None
    sys.argv = sys.argv[1:]  # the step sees its own command line
    sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))  # and imports common/ from beside it
    runpy.run_path(sys.argv[0], run_name="__main__")
