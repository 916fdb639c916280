"""Training throughput of every step, measured back to back in one run, as a table with ratios.

    python benchmarks/throughput.py                    # synthetic data
    python benchmarks/throughput.py --real-cifar10     # real CIFAR-10 images from ../shared/data
    python benchmarks/throughput.py --amp bf16 --nproc 1 --nondeterministic   # on one GPU, both ways

Each CIFAR-10 step (01-05) trains for --max-steps steps with the same global batch and reports
`samples_per_second` from its metrics.json (training only: evaluation excluded). 04 and 05 run on
this machine with --nproc processes under torchrun (gloo on CPUs, nccl on GPUs). With --real-cifar10 the steps read the
array layout (`train.npz`, `test.npz`) that common/data.py accepts, made of symbolic links to
../shared/data/cifar10 (the full training set and the first 1,017 official test images).
With --nondeterministic each step runs a second time through benchmarks/nondeterministic.py,
without the deterministic algorithms that exact resume needs, and the table shows what they cost.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_CIFAR10 = ROOT.parent / "shared" / "data" / "cifar10"
BIN = Path(sys.executable).parent


def launch_commands(nproc, wrapper=()):
    """{script: its command line}; `wrapper` (a script that runs the step) goes before the step's name."""
    torchrun = [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *wrapper]
    python = [sys.executable, *wrapper]
    return {
        "01_cifar10_cpu.py": [*python, "01_cifar10_cpu.py"],
        "02_cifar10_gpu.py": [*python, "02_cifar10_gpu.py"],
        "03_cifar10_dataparallel.py": [*python, "03_cifar10_dataparallel.py"],
        "04_cifar10_ddp.py": [*torchrun, "04_cifar10_ddp.py"],
        "05_cifar10_deepspeed.py": [*torchrun, "05_cifar10_deepspeed.py"],  # the config's ZeRO-2
    }


def real_cifar10_dir(scratch):
    """A `--data-dir` in the array layout, linking to the real images in ../shared/data/cifar10."""
    if not SHARED_CIFAR10.is_dir():
        sys.exit(f"error: {SHARED_CIFAR10} not found: --real-cifar10 needs ../shared/data beside the repository")
    os.symlink(SHARED_CIFAR10 / "train.npz", scratch / "train.npz")
    os.symlink(SHARED_CIFAR10 / "test_first1017.npz", scratch / "test.npz")
    return scratch


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--real-cifar10", action="store_true", help="real CIFAR-10 images from ../shared/data")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="processes for the multi-process steps")
    parser.add_argument("--steps", nargs="*", help="only these scripts")
    parser.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none",
                        help="mixed precision for the steps that have it (02-05)")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="also run each step without deterministic algorithms, and compare")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        data = ["--data-dir", str(real_cifar10_dir(scratch))] if args.real_cifar10 else ["--synthetic"]
        # As many epochs as steps: --max-steps ends the run, whatever the size of the data set.
        common = [*data, "--batch-size", str(args.batch_size), "--max-steps", str(args.max_steps),
                  "--epochs", str(args.max_steps), "--num-workers", "0"]
        # gloo on the loopback interface; the environment's bin on PATH for DeepSpeed's ninja.
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
               "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}
        variants = {"deterministic": ()}
        if args.nondeterministic:
            variants["nondeterministic"] = ("benchmarks/nondeterministic.py",)
        results = {}
        for variant, wrapper in variants.items():
            for script, command in launch_commands(args.nproc, wrapper).items():
                if args.steps and script not in args.steps:
                    continue
                amp = [] if script == "01_cifar10_cpu.py" else ["--amp", args.amp]  # 01 trains in fp32
                output_dir = scratch / variant / script
                subprocess.run([*command, *common, *amp, "--output-dir", str(output_dir)], cwd=ROOT, env=env,
                               check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results[script, variant] = json.loads((output_dir / "metrics.json").read_text())

    baseline = next(iter(results.values()))["samples_per_second"]
    print(f"data: {'CIFAR-10 (real images)' if args.real_cifar10 else 'synthetic'}, global batch "
          f"{args.batch_size}, {args.max_steps} steps, --amp {args.amp}, {os.cpu_count()} CPU cores")
    print(f"{'script':<28} {'algorithms':<16} {'device':<6} {'world':>5} {'amp':>5} {'samples/s':>10} {'vs first':>9} "
          f"{'vs deterministic':>17}")
    for (script, variant), metrics in results.items():
        speed = metrics["samples_per_second"]
        print(f"{script:<28} {variant:<16} {metrics['device']:<6} {metrics['world_size']:>5} {metrics['amp']:>5} "
              f"{speed:>10.1f} {speed / baseline:>9.2f} "
              f"{speed / results[script, 'deterministic']['samples_per_second']:>17.2f}")


if __name__ == "__main__":
    main()
