"""Who sends what to whom: broadcast, all-reduce, reduce-scatter and all-gather, measured on 4 processes.

    python benchmarks/collectives_figure.py --output docs/collectives.png

Starts 4 processes on this machine (torch.multiprocessing, gloo on 127.0.0.1, no GPU needed), runs each
collective on small integer tensors, and prints what every rank held before and after. The picture draws
those measured values; a cell's colour says which rank its value comes from, grey a sum over all ranks.
All-gather starts from reduce-scatter's result: the two together give all-reduce's, which is how FSDP and
ZeRO split one all-reduce in two (docs/collectives.md).
"""

import argparse
import datetime
from pathlib import Path

import torch
import torch.distributed as dist
from launch import in_local_processes

WORLD_SIZE = 4
# A peer that never arrives fails the run in seconds: gloo's default wait is 30 minutes.
TIMEOUT = datetime.timedelta(seconds=60)
# (name, the call as the steps write it), in the order they run and are drawn.
CALLS = [("broadcast", "dist.broadcast(t, src=0)"),
         ("all-reduce", "dist.all_reduce(t)"),
         ("reduce-scatter", "dist.reduce_scatter_single(shard, t)"),
         ("all-gather", "dist.all_gather_single(t, shard)")]


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    return parser.parse_args(argv)


def collectives(rank):
    """One process: every collective once, on tensors that show where each value came from."""
    # Rank r holds 10(r + 1) + i at position i: the tens say which rank a value left, the units where.
    mine = torch.arange(WORLD_SIZE) + 10 * (rank + 1)
    results = {}
    t = mine.clone()
    dist.broadcast(t, src=0)
    results["broadcast"] = (mine.tolist(), t.tolist())
    t = mine.clone()
    dist.all_reduce(t)  # the default op is a sum
    results["all-reduce"] = (mine.tolist(), t.tolist())
    shard = torch.empty(1, dtype=mine.dtype)
    dist.reduce_scatter_single(shard, mine)  # rank r keeps the sum of everyone's element r
    results["reduce-scatter"] = (mine.tolist(), shard.tolist())
    t = torch.empty(WORLD_SIZE, dtype=mine.dtype)
    dist.all_gather_single(t, shard)  # every rank gets every rank's shard, in rank order
    results["all-gather"] = (shard.tolist(), t.tolist())
    return results


def measure():
    """{collective: [(before, after) of rank 0, 1, ...]}, from 4 real processes."""
    by_rank = in_local_processes(collectives, WORLD_SIZE, TIMEOUT)
    return {name: [by_rank[rank][name] for rank in range(WORLD_SIZE)] for name, _ in CALLS}


def report(results):
    """The measured values as text: one line per rank and collective."""
    lines = []
    for name, call in CALLS:
        lines.append(f"{name}: {call}")
        lines += [f"  rank {rank}: {before} -> {after}" for rank, (before, after) in enumerate(results[name])]
    return "\n".join(lines)


def sources(name, rank, before, after):
    """The rank each cell's value comes from, before and after `name` (None: a sum over every rank)."""
    if name == "broadcast":
        return [rank] * len(before), [0] * len(after)
    if name == "all-reduce":
        return [rank] * len(before), [None] * len(after)
    if name == "reduce-scatter":
        return [rank] * len(before), [None]
    return [rank], list(range(len(after)))  # all-gather


def draw(results, path):
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    colours = plt.get_cmap("Pastel1").colors
    figure, axes = plt.subplots(2, 2, figsize=(11, 6.4))
    for axis, (name, call) in zip(axes.flat, CALLS, strict=True):
        axis.set_title(f"{name}: {call}", family="monospace", fontsize=10)
        axis.set_xlim(-1.6, 10.2)
        axis.set_ylim(-0.5, WORLD_SIZE + 0.3)
        axis.axis("off")
        for start, label, values in zip((0, 6), ("before", "after"), results[name][0], strict=True):
            axis.text(start + len(values) / 2, WORLD_SIZE - 0.1, label, ha="center")
        axis.add_patch(FancyArrowPatch((4.3, WORLD_SIZE / 2 - 0.5), (5.7, WORLD_SIZE / 2 - 0.5),
                                       arrowstyle="-|>", mutation_scale=20, color="0.3"))
        for rank, (before, after) in enumerate(results[name]):
            y = WORLD_SIZE - 1 - rank
            axis.text(-0.2, y + 0.4, f"rank {rank}", ha="right", va="center", fontsize=9)
            for start, values, froms in zip((0, 6), (before, after), sources(name, rank, before, after), strict=True):
                for i, (value, source) in enumerate(zip(values, froms, strict=True)):
                    axis.add_patch(Rectangle((start + i, y), 0.95, 0.8, edgecolor="0.4",
                                             facecolor="0.8" if source is None else colours[source]))
                    axis.text(start + i + 0.475, y + 0.4, str(value), ha="center", va="center", fontsize=9)
    version = torch.__version__.split("+")[0]
    figure.suptitle(f"Measured on {WORLD_SIZE} processes (gloo, torch {version}). Colour: the rank a value comes "
                    "from; grey: a sum over all ranks.\nReduce-scatter, then all-gather: all-reduce's result.",
                    fontsize=10)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=80)


def main(argv=None):
    args = parse_args(argv)
    results = measure()
    print(report(results))
    draw(results, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
