"""Run a step script with CUDA's sync debug mode on, and report every call that makes the CPU wait for
the GPU (tests/test_gpu.py reads the report).

    torchrun --standalone --nproc_per_node=2 tests/sync_debug.py 04_cifar10_ddp.py --synthetic --max-steps 30

On stderr, one line per synchronising call: `sync: FILE:LINE FUNCTION | LIBRARY_FILE:LINE`, the innermost
frame of this repository's code (absolute paths) and the innermost Python frame of all (where a library
synchronised). A loop that hides a synchronisation (a copy from pageable memory, a `.item()`, a
tensor's truth value) waits for the GPU at every step, and the GPU idles while the CPU queues the next one.
"""

import os
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from launch import run_step_here  # noqa: E402


def report(message, category, filename, lineno, file=None, line=None):
    if "synchronizing" not in str(message):
        return show(message, category, filename, lineno, file, line)
    # The stack of the call that synchronised: this function and the warnings module's frames left out.
    stack = [frame for frame in traceback.extract_stack()[:-1] if not frame.filename.endswith("warnings.py")]
    for frame in stack:
        frame.filename = os.path.abspath(frame.filename)  # runpy runs the step by a relative path
    ours = [frame for frame in stack if frame.filename.startswith(str(ROOT)) and "/.venv/" not in frame.filename]
    where = f"{ours[-1].filename}:{ours[-1].lineno} {ours[-1].name}" if ours else "-"
    print(f"sync: {where} | {stack[-1].filename}:{stack[-1].lineno}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    show = warnings.showwarning
    warnings.showwarning = report
    warnings.simplefilter("always")  # every synchronisation, not the first of each line only
    torch.cuda.set_sync_debug_mode("warn")
    run_step_here(sys.argv[1:])
