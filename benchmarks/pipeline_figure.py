"""When each stage works: GPipe and 1F1B on 4 pipeline stages, from the order the schedules really run.

    python benchmarks/pipeline_figure.py --output docs/pipeline-parallel.png

Starts 4 processes on this machine (torch.multiprocessing, gloo on 127.0.0.1, no GPU needed). Each holds one
stage of a small linear model and runs one training step of torch.distributed.pipelining's ScheduleGPipe and
Schedule1F1B, noting the order in which its stage runs the forward (F) and backward (B) of each
micro-batch. The picture lays those orders out in time, with a forward taking one unit and a backward two
(a backward computes the gradients of both the inputs and the weights): a stage starts a micro-batch's
forward once the previous stage has finished it, and its backward once the next stage has. Blank cells
are the bubble: a stage waiting. The table gives the bubble's share of the step for more micro-batch
counts, and the most micro-batches whose activations a stage holds at once.
"""

import argparse
import datetime
from pathlib import Path

import torch
from launch import in_local_processes
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.pipelining.stage import _PipelineStageBase

STAGES = 4
MICROBATCHES = (4, 8, 16)  # the table's; the picture draws the middle one
DRAWN = 8
SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B}
DURATION = {"F": 1, "B": 2}  # time units of a forward and of a backward
TIMEOUT = datetime.timedelta(seconds=60)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    return parser.parse_args(argv)


def record_orders(rank):
    """One stage: a training step of each schedule at each micro-batch count; this stage's orders."""
    order = []
    for method, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B")):
        original = getattr(_PipelineStageBase, method)

        def noting(stage, chunk, *args, _original=original, _kind=kind, **kwargs):
            order.append(f"{_kind}{chunk}")
            return _original(stage, chunk, *args, **kwargs)
        setattr(_PipelineStageBase, method, noting)
    orders = {}
    for name, schedule_class in SCHEDULES.items():
        for microbatches in MICROBATCHES:
            torch.manual_seed(0)
            stage = PipelineStage(torch.nn.Linear(8, 8), rank, STAGES, torch.device("cpu"))
            schedule = schedule_class(stage, n_microbatches=microbatches, loss_fn=lambda out, target: out.sum())
            inputs = [torch.randn(2 * microbatches, 8)] if rank == 0 else []
            order.clear()
            schedule.step(*inputs, target=torch.zeros(2 * microbatches, 8))
            orders[name, microbatches] = list(order)
    return orders


def lay_out(orders):
    """{stage: [(start, action)]}: each stage runs its actions in its order, each as soon as its input is ready."""
    finished, timeline, free_at = {}, {stage: [] for stage in orders}, dict.fromkeys(orders, 0)
    pending = {stage: list(actions) for stage, actions in orders.items()}
    while any(pending.values()):
        progressed = False
        for stage, actions in pending.items():
            if not actions:
                continue
            action = actions[0]
            kind = action[0]
            neighbour = stage - 1 if kind == "F" else stage + 1
            if 0 <= neighbour < len(orders) and (neighbour, action) not in finished:
                continue  # its input has not arrived
            start = max(free_at[stage], finished.get((neighbour, action), 0))
            finished[stage, action] = free_at[stage] = start + DURATION[kind]
            timeline[stage].append((start, action))
            actions.pop(0)
            progressed = True
        if not progressed:
            raise RuntimeError(f"the recorded orders deadlock: {pending}")
    return timeline


def in_flight(order):
    held = peak = 0
    for action in order:
        held += 1 if action[0] == "F" else -1
        peak = max(peak, held)
    return peak


def draw(layouts, output):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(layouts), 1, figsize=(11, 1.1 + 0.55 * STAGES * len(layouts)))
    length = max(start + DURATION[action[0]] for timeline in layouts.values()
                 for steps in timeline.values() for start, action in steps)
    for axis, (name, timeline) in zip(axes, layouts.items(), strict=True):
        for stage, steps in timeline.items():
            for start, action in steps:
                colour = plt.cm.Blues if action[0] == "F" else plt.cm.Oranges
                shade = colour(0.35 + 0.5 * int(action[1:]) / DRAWN)
                axis.barh(stage, DURATION[action[0]], left=start, height=0.8, color=shade, edgecolor="white")
                axis.text(start + DURATION[action[0]] / 2, stage, action, ha="center", va="center", fontsize=8)
        end = max(start + DURATION[action[0]] for steps in timeline.values() for start, action in steps)
        busy = sum(DURATION[action[0]] for steps in timeline.values() for _, action in steps)
        axis.set_title(f"{name}: {STAGES} stages, {DRAWN} micro-batches, one step takes {end} units; "
                       f"bubble {1 - busy / (end * STAGES):.0%}", fontsize=10, loc="left")
        axis.set_yticks(range(STAGES), [f"stage {stage}" for stage in range(STAGES)])
        axis.set_ylim(STAGES - 0.5, -0.5)
        axis.set_xlim(0, length)
        axis.set_xlabel("time (a forward F = 1 unit, a backward B = 2)")
    figure.tight_layout()
    figure.savefig(output, dpi=110)


def main():
    args = parse_args()
    per_stage = in_local_processes(record_orders, STAGES, TIMEOUT)
    print(f"{'schedule':<9} {'micro-batches':>13} {'time units':>10} {'bubble':>7}  most micro-batches held, per stage")
    layouts = {}
    for name in SCHEDULES:
        for microbatches in MICROBATCHES:
            orders = {stage: per_stage[stage][name, microbatches] for stage in range(STAGES)}
            timeline = lay_out(orders)
            end = max(start + DURATION[action[0]] for steps in timeline.values() for start, action in steps)
            busy = sum(DURATION[action[0]] for order in orders.values() for action in order)
            held = " ".join(str(in_flight(orders[stage])) for stage in range(STAGES))
            print(f"{name:<9} {microbatches:>13} {end:>10} {1 - busy / (end * STAGES):>7.0%}  {held}")
            if microbatches == DRAWN:
                layouts[name] = timeline
    draw(layouts, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
