"""Which attention kernels compute the same gradients twice on this GPU, with deterministic algorithms on.

    python benchmarks/attention_determinism.py

Step 09's transformer calls `F.scaled_dot_product_attention`, which picks one of several kernels (flash,
memory-efficient, cuDNN, math). Under `torch.use_deterministic_algorithms(True, warn_only=True)`, the mode
the steps use on GPUs (common/utils.py), a kernel without a deterministic backward warns and runs anyway,
and a run stopped and resumed then drifts from one that never stopped. For each kernel and for the default
choice, in bf16 at 09's shapes, this runs one forward and backward pass twice on the same inputs and prints
whether the gradients are equal bit for bit, with the warning or error it raised.
"""

import argparse
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
    print(f"{'kernel':<10} {'warn_only':<10} {'equal grads':<12} message")
    for warn_only in (True, False):
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        for name, backend in BACKENDS.items():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    first = gradients(q, k, v, backend)
                    equal = all(all(torch.equal(a, b) for a, b in zip(first, gradients(q, k, v, backend),
                                                                       strict=True))
                                for _ in range(args.repeats))
                    message = "; ".join(sorted({str(w.message).splitlines()[0][:90] for w in caught}))
                except RuntimeError as error:
                    equal, message = "-", str(error).splitlines()[0][:90]
            print(f"{name:<10} {warn_only!s:<10} {equal!s:<12} {message}")


if __name__ == "__main__":
    main()
