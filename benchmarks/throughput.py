"""Training throughput of every CIFAR-10 step, measured back to back in one run, as a table with ratios.

    python benchmarks/throughput.py                          # synthetic data
    python benchmarks/throughput.py --data-dir ./data        # real CIFAR-10 images (a step's --data-dir)
    python benchmarks/throughput.py --amp bf16 --nproc 1 --nondeterministic   # on one GPU, both ways

Each CIFAR-10 step (01-05, 07-09) trains for --max-steps steps with the same global batch and reports
`samples_per_second` from its metrics.json (training only: evaluation excluded). 04, 05 (the config's ZeRO-2),
07 (FSDP2), 08 (--nproc pipeline stages, 4 micro-batches, 1F1B) and 09 (its vision transformer,
tensor-parallel groups of 2) run with --nproc processes under torchrun (gloo on CPUs, NCCL on GPUs); 08 and 09
have no fp16, and 05 none without a GPU (leave them out with --steps). 09 trains another model: its row
compares methods and models together. Timings on a shared machine are noisy: every step runs --repeat times,
in interleaved rounds, and the table shows the best of them. With --nondeterministic each step also runs through
benchmarks/nondeterministic.py, without deterministic GPU kernels, and the last column shows what
determinism costs (on a CPU the steps use none, and the column shows the noise).
"""

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import launch
import torch

STEPS = ["01", "02", "03", "04", "05", "07", "08", "09"]


def command(step, nproc, wrapper=()):
    """The step's launch command: torchrun for the multi-process steps, python for the others;
    `wrapper` (a script that runs the step, such as benchmarks/nondeterministic.py) goes before it."""
    script, *wrapped = [*wrapper, launch.SCRIPTS[step]]
    if step in ("04", "05", "07", "08", "09"):
        return launch.torchrun(nproc, script, *wrapped)
    return launch.python(script, *wrapped)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="real CIFAR-10, as a step's --data-dir (default: the synthetic data)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch size")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--nproc", type=int, default=2, help="processes for the multi-process steps")
    parser.add_argument("--steps", nargs="*", choices=STEPS, default=STEPS, help="only these steps")
    parser.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none",
                        help="mixed precision for the steps that have it (02-05, 07-09; 08, 09: not fp16)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each step; the best counts")
    parser.add_argument("--nondeterministic", action="store_true",
                        help="also run each step without deterministic GPU kernels, and compare")
    return parser.parse_args(argv)


def main():
    args = parse_args()

    data = ["--data-dir", args.data_dir] if args.data_dir else ["--synthetic"]
    # As many epochs as steps: --max-steps ends the run, whatever the size of the data set.
    common = [*data, "--batch-size", args.batch_size, "--max-steps", args.max_steps, "--epochs", args.max_steps,
              "--num-workers", 0]
    variants = {"as written": ()}
    if args.nondeterministic:
        variants["nondeterministic"] = ("benchmarks/nondeterministic.py",)
    results = {}  # (step, variant): the metrics of its fastest run
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeat):
            for variant, wrapper in variants.items():
                for step in args.steps:
                    amp = [] if step == "01" else ["--amp", args.amp]  # 01 trains in fp32
                    output_dir = Path(scratch) / "run"
                    subprocess.run([*command(step, args.nproc, wrapper), *map(str, common), *amp,
                                    "--output-dir", str(output_dir)], cwd=launch.ROOT, env=launch.environment(),
                                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    metrics = json.loads((output_dir / "metrics.json").read_text())
                    best = results.get((step, variant))
                    if best is None or metrics["samples_per_second"] > best["samples_per_second"]:
                        results[step, variant] = metrics

    baseline = next(iter(results.values()))["samples_per_second"]
    print(f"data: {'synthetic' if not args.data_dir else args.data_dir}, global batch {args.batch_size}, "
          f"{args.max_steps} steps, --amp {args.amp}, best of {args.repeat}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name() if launch.ON_GPU else 'CPU'}")
    print(f"{'script':<28} {'kernels':<16} {'device':<6} {'world':>5} {'amp':>5} {'samples/s':>10} {'vs first':>9} "
          f"{'vs as written':>14}")
    for (step, variant), metrics in results.items():
        speed = metrics["samples_per_second"]
        print(f"{metrics['script']:<28} {variant:<16} {metrics['device']:<6} {metrics['world_size']:>5} "
              f"{metrics['amp']:>5} {speed:>10.1f} {speed / baseline:>9.2f} "
              f"{speed / results[step, 'as written']['samples_per_second']:>14.2f}")


if __name__ == "__main__":
    main()
