"""Parity: a distributed run ends with the weights of the single-process run.

    python benchmarks/parity.py              # the table in docs/parity.md
    python benchmarks/parity.py --float32    # the same runs without float64: rounding takes over
    python benchmarks/parity.py --norm batch # the CIFAR-10 steps with their default BatchNorm

Every row trains on the synthetic data with the same seed, global batch (8) and data order, for
the same number of optimizer steps (without loader workers, which change nothing that is computed), and
compares its model.pt with its reference row's: the largest relative difference max|a - b| / max|b| over
all tensors. The runs use the setting that makes the result independent of how a batch is split across
processes: `--norm group` (GroupNorm instead of BatchNorm) in the ResNet-9 steps, `--no-dropout` in 06 and
09-11 (10's vision transformer is compared with 09's in a world of one, 11's mixture of experts with 11's).

Most rows run in float64 (benchmarks/float64.py): in float32, summing the same gradients in
another order rounds differently, and ReLU and max-pooling amplify that chaotically within a few
steps. DeepSpeed keeps fp32 master weights, and reduces float64 gradients only with ZeRO-1 and 2,
so 05 runs in float32, for 2 steps, before the amplification sets in (tests/test_deepspeed.py shows
that over 30 steps 05 takes exactly 04's steps: its weights equal 04's bit for bit).
tests/test_parity.py runs every row and holds it to TOLERANCE.
"""

import argparse
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import launch
import torch

# Largest relative difference a row may show. float64 rows measure 1e-15 to 1.3e-12; BatchNorm over
# per-process batches instead of the whole one (--norm batch) shows differences of order 1.
TOLERANCE = {"float64": 1e-9, "float32": 1e-4}

CIFAR10 = ["--lr", "0.1"]
MNIST = ["--no-dropout", "--lr", "0.05"]
VIT = ["--no-dropout", "--lr", "1e-3"]  # 09's vision transformer: LayerNorm, nothing that depends on the batch
STEPS = 20
FLOAT32_STEPS = 2  # float32 rounding differences stay near 1e-7 for 2 steps; by 5 they pass 1e-2


@dataclass(frozen=True)
class Row:
    name: str
    script: str
    launcher: str  # a key of launch.LAUNCHERS
    nproc: int
    dtype: str
    steps: int
    reference: str | None  # the name of the row it must match
    args: tuple = ()


ROWS = [
    Row("01", "01_cifar10_cpu.py", "python", 1, "float64", STEPS, None),
    Row("03", "03_cifar10_dataparallel.py", "python", 1, "float64", STEPS, "01"),
    Row("04 x2", "04_cifar10_ddp.py", "torchrun", 2, "float64", STEPS, "01"),
    Row("04 x4", "04_cifar10_ddp.py", "torchrun", 4, "float64", STEPS, "01"),
    Row("07 x2", "07_cifar10_fsdp.py", "torchrun", 2, "float64", STEPS, "01"),
    Row("08 2x1", "08_cifar10_pipeline.py", "torchrun", 2, "float64", STEPS, "01"),
    Row("08 2x2", "08_cifar10_pipeline.py", "torchrun", 4, "float64", STEPS, "01",
        ("--stages", "2", "--schedule", "gpipe", "--microbatches", "2")),
    Row("09 x1", "09_cifar10_tensor_parallel.py", "python", 1, "float64", STEPS, None),
    Row("09 x2", "09_cifar10_tensor_parallel.py", "torchrun", 2, "float64", STEPS, "09 x1"),
    Row("09 2x2", "09_cifar10_tensor_parallel.py", "torchrun", 4, "float64", STEPS, "09 x1"),
    Row("10 x2", "10_cifar10_context_parallel.py", "torchrun", 2, "float64", STEPS, "09 x1"),
    Row("10 x4", "10_cifar10_context_parallel.py", "torchrun", 4, "float64", STEPS, "09 x1", ("--cp-size", "4")),
    Row("10 2x2", "10_cifar10_context_parallel.py", "torchrun", 4, "float64", STEPS, "09 x1"),
    Row("11 x1", "11_cifar10_expert_parallel.py", "python", 1, "float64", STEPS, None),
    Row("11 x2", "11_cifar10_expert_parallel.py", "torchrun", 2, "float64", STEPS, "11 x1"),
    Row("11 x4", "11_cifar10_expert_parallel.py", "torchrun", 4, "float64", STEPS, "11 x1", ("--ep-size", "4")),
    Row("11 2x2", "11_cifar10_expert_parallel.py", "torchrun", 4, "float64", STEPS, "11 x1"),
    Row("01 fp32", "01_cifar10_cpu.py", "python", 1, "float32", FLOAT32_STEPS, None),
    Row("05 ZeRO-0 x2", "05_cifar10_deepspeed.py", "torchrun", 2, "float32", FLOAT32_STEPS, "01 fp32",
        ("--zero-stage", "0")),
    Row("05 ZeRO-2 x2", "05_cifar10_deepspeed.py", "torchrun", 2, "float32", FLOAT32_STEPS, "01 fp32",
        ("--zero-stage", "2")),
    Row("06 x1", "06_mnist_accelerate.py", "python", 1, "float64", STEPS, None),
    Row("06 x2", "06_mnist_accelerate.py", "accelerate", 2, "float64", STEPS, "06 x1"),
]
ROWS_BY_NAME = {row.name: row for row in ROWS}

# One thread per process everywhere (torchrun's default for its workers): another thread count can
# take another summation order inside a convolution, which float32 would show.
ENV = launch.environment({"OMP_NUM_THREADS": "1"})


def command(row, output_dir, dtype=None, norm="group", data=("--synthetic", "--epochs", 1)):
    """The command line of `row`, writing into `output_dir`; `dtype` overrides the row's. `data`: the data set
    and the number of epochs (tests/test_parity.py trains on a small data set for 2 epochs)."""
    in_float64 = ["benchmarks/float64.py"] if (dtype or row.dtype) == "float64" else []
    options = {"06": MNIST, "09": VIT, "10": VIT, "11": VIT}.get(row.script[:2], [*CIFAR10, "--norm", norm])
    script, *wrapped = [*in_float64, row.script]
    # accelerate launch without the config's fp16: the reference row runs in full precision too.
    precision = {"config_precision": False} if row.launcher == "accelerate" else {}
    return launch.LAUNCHERS[row.launcher](
        row.nproc, script, *wrapped, *data, "--num-workers", 0, "--batch-size", 8, "--max-steps", row.steps,
        *options, *row.args, "--output-dir", output_dir, **precision)


def max_relative_difference(path_a, path_b):
    """The largest max|a - b| / max|b| over the tensors of two state_dicts (inf if they differ in keys)."""
    a, b = (torch.load(path, map_location="cpu", weights_only=True) for path in (path_a, path_b))
    if a.keys() != b.keys():
        return float("inf")
    worst = 0.0
    for name, tensor in b.items():
        difference = (a[name].double() - tensor.double()).abs().max().item()
        worst = max(worst, difference / (tensor.double().abs().max().item() or 1.0))
    return worst


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--float32", action="store_true", help="run the float64 rows in float32")
    parser.add_argument("--norm", choices=["group", "batch"], default="group", help="the CIFAR-10 steps' --norm")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    dtype = "float32" if args.float32 else None

    print(f"synthetic data, global batch 8, --norm {args.norm}, {'CUDA' if launch.ON_GPU else 'CPU, gloo'}, "
          f"torch {torch.__version__}")
    print(f"{'row':<14} {'launcher':<10} {'world':>5} {'dtype':<8} {'steps':>5} {'reference':<9} {'max rel. diff':>13}")
    with tempfile.TemporaryDirectory() as scratch:
        for row in ROWS:
            output_dir = Path(scratch) / row.name
            subprocess.run(command(row, output_dir, dtype, args.norm), cwd=launch.ROOT, env=ENV, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
            if row.reference:
                difference = max_relative_difference(output_dir / "model.pt",
                                                     Path(scratch) / row.reference / "model.pt")
                print(f"{row.name:<14} {row.launcher:<10} {row.nproc:>5} {dtype or row.dtype:<8} {row.steps:>5} "
                      f"{row.reference:<9} {difference:>13.1e}", flush=True)


if __name__ == "__main__":
    main()
