"""Which attention kernels compute the same gradients twice on this GPU, with deterministic algorithms on.

    python benchmarks/attention_determinism.py

Step 09's transformer calls `F.scaled_dot_product_attention`, which picks one of several kernels (flash,
memory-efficient, cuDNN, math). Under `torch.use_deterministic_algorithms(True, warn_only=True)`, the mode
steps 02-08 use on GPUs (common/utils.py), a kernel without a deterministic backward warns and runs anyway,
and a run stopped and resumed then drifts from one that never stopped. For each kernel and for the default
choice, in bf16 at 09's shapes, this runs one forward and backward pass 1 + --repeats times on the same
inputs and prints whether the gradients are equal bit for bit, with the warning or error it raised, and what
a pass costs: its time (the median of the repeats) and the memory it holds at its peak beyond the inputs.

Step 09 runs the strict mode (`warn_only=False`; common/utils.py's use_deterministic_kernels(strict=True)).
"""

import argparse
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}


def gradients(q, k, v, backend):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if backend is None:
        out = F.scaled_dot_product_attention(q, k, v)
    else:
        with sdpa_kernel([backend]):
            out = F.scaled_dot_product_attention(q, k, v)
    out.backward(torch.ones_like(out))
    return out.detach(), q.grad, k.grad, v.grad


def timed_gradients(q, k, v, backend):
    """gradients(), with its time in milliseconds and its peak memory in MiB beyond what was held before it."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    held, start = torch.cuda.memory_allocated(), time.perf_counter()
    result = gradients(q, k, v, backend)
    torch.cuda.synchronize()
    return result, (time.perf_counter() - start) * 1e3, (torch.cuda.max_memory_allocated() - held) / 2**20


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # 09's defaults: batch 256 on one rank, 4 heads (2 per rank at --tp-size 2), 64 tokens, 32 features per head.
    parser.add_argument("--shape", type=int, nargs=4, default=[256, 4, 64, 32], metavar=("B", "H", "T", "D"))
    parser.add_argument("--repeats", type=int, default=5, help="second runs compared with the first")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}, shape {args.shape}, bf16")
    torch.manual_seed(0)
    q, k, v = (torch.randn(*args.shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    print(f"{'kernel':<10} {'warn_only':<10} {'equal grads':<12} {'ms':>8} {'MiB':>8}  message")
    for warn_only in (True, False):
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        for name, backend in BACKENDS.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    first = gradients(q, k, v, backend)  # the first pass also warms the kernel up
                    repeats = [timed_gradients(q, k, v, backend) for _ in range(args.repeats)]
                    equal = all(torch.equal(a, b) for again, _, _ in repeats for a, b in zip(first, again,
                                                                                              strict=True))
                    milliseconds = f"{statistics.median(ms for _, ms, _ in repeats):.2f}"
                    mebibytes = f"{max(mib for _, _, mib in repeats):.0f}"
                    message = "; ".join(sorted({str(w.message).splitlines()[0][:90] for w in caught}))
                except RuntimeError as error:
                    equal, milliseconds, mebibytes, message = "-", "-", "-", str(error).splitlines()[0][:90]
            print(f"{name:<10} {warn_only!s:<10} {equal!s:<12} {milliseconds:>8} {mebibytes:>8}  {message}")


if __name__ == "__main__":
    main()
