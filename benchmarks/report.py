"""A picture of runs: each run's training throughput side by side, and its test accuracy over time.

    bash tour.sh && python benchmarks/report.py runs/[01]*/ --output runs/tour.png
    python benchmarks/report.py RUN_DIR [RUN_DIR ...] --output report.png

Each RUN_DIR is a step's --output-dir: its metrics.json gives `samples_per_second` (training only) and
`history` (step, elapsed seconds, losses and test accuracy after each epoch): one point per epoch, at the
seconds since the run started training (evaluation included).
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display needed
import matplotlib.pyplot as plt  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", type=Path, help="--output-dir of each run")
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    parser.add_argument("--title", default="", help="a line above both panels (for example the machine)")
    return parser.parse_args(argv)


def label(metrics):
    script = metrics["script"].removesuffix(".py")
    details = [f"x{metrics['world_size']}"] + ([metrics["amp"]] if metrics["amp"] != "none" else [])
    return f"{script} ({', '.join(details)})"


def main():
    args = parse_args()
    runs = []
    for run_dir in args.run_dirs:
        path = run_dir / "metrics.json"
        if not path.is_file():
            raise SystemExit(f"error: {path} not found: give the --output-dir of a finished run")
        runs.append(json.loads(path.read_text()))

    figure, (speed, accuracy) = plt.subplots(1, 2, figsize=(12, 0.5 * len(runs) + 2.5),
                                             gridspec_kw={"width_ratios": [1, 1.3]})
    labels = [label(metrics) for metrics in runs]
    speed.barh(labels, [metrics["samples_per_second"] for metrics in runs], color="tab:blue")
    speed.invert_yaxis()  # the first run on top
    speed.set_xlabel("training images per second (all processes)")
    # 20 colours: the default cycle's 10 would give the eleventh run the first's.
    for index, (metrics, name) in enumerate(zip(runs, labels, strict=True)):
        history = metrics["history"]
        accuracy.plot([epoch["elapsed_seconds"] for epoch in history], [epoch["test_accuracy"] for epoch in history],
                      marker="o", label=name, color=plt.get_cmap("tab20")(index % 20))
    accuracy.axhline(0.1, color="grey", linestyle=":", linewidth=1)  # chance: 10 classes
    accuracy.set_xlabel("seconds since the start of training")
    accuracy.set_ylabel("test accuracy")
    accuracy.legend(fontsize="small")
    if args.title:
        figure.suptitle(args.title)
    figure.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
