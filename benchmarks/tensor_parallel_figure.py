"""What each rank of a tensor-parallel group holds, and where the collectives run: step 09's plan, measured.

    python benchmarks/tensor_parallel_figure.py --output docs/tensor-parallel.png

Starts processes on this machine (torch.multiprocessing, gloo on 127.0.0.1, no GPU needed): 2 (tp 2), then 4
(tp 4), then 4 again (2 replicas of tp 2). Each builds models.VisionTransformer, splits it with step 09's plan,
shards it with FSDP2 across the replicas as 09 does, and runs one training forward and backward under
loss_parallel. Torch's CommDebugMode sees every collective and the module that was running when it started;
forward hooks record what each module of block 0 receives and returns. The first table follows block 0 on rank 0
through the forward pass, with the collectives where they run; the second lists block 0's collectives in the
backward pass; the third counts one step's collectives, in block 0 and in the whole model. The picture draws
block 0 at tp 2: what each rank holds after each module, and which collective joins the ranks in between.
"""

import argparse
import datetime
import functools
import sys
import warnings
from collections import defaultdict, namedtuple
from pathlib import Path

import launch
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

sys.path.insert(0, str(launch.ROOT))  # common/ is beside benchmarks/
from common import models  # noqa: E402

# Step 09's plan, copied: the step shows it in full (it is the lesson), and a benchmark never imports a step.
# tests/test_docs.py checks that the copies stay the same.
BLOCK_PLAN = {
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "attention.query": ColwiseParallel(),
    "attention.key": ColwiseParallel(),
    "attention.value": ColwiseParallel(),
    "attention.output": RowwiseParallel(output_layouts=Shard(1)),
    "mlp_norm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
    "mlp.up": ColwiseParallel(),
    "mlp.down": RowwiseParallel(output_layouts=Shard(1)),
}
MODEL_PLAN = {
    "embedding": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1)),
    "norm": SequenceParallel(),
    "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
}
# (processes, tp size): a group of 2, a group of 4, and 2 replicas of a group of 2 (FSDP2 between them).
RUNS = ((2, 2), (4, 4), (4, 2))
BATCH = 2  # images per replica: the shapes are per image, and the counts do not depend on it
PLANS = {SequenceParallel: "sequence", ColwiseParallel: "colwise", RowwiseParallel: "rowwise"}
COLLECTIVES = {"all_gather_into_tensor": "all-gather", "_allgather_base_": "all-gather",
               "reduce_scatter_tensor": "reduce-scatter", "_reduce_scatter_base_": "reduce-scatter",
               "all_reduce": "all-reduce", "all_to_all_single": "all-to-all"}
MIRROR = {"all-gather": "reduce-scatter", "reduce-scatter": "all-gather"}  # what the backward pass runs instead
TIMEOUT = datetime.timedelta(seconds=60)

# A module of block 0 ran: the shapes it received and returned on this rank, per image, and "partial" where the
# values are partial sums. A collective started: in which group, inside which module, in which pass, and how
# many values this rank put in.
Module = namedtuple("Module", "name shape_in kind_in shape_out kind_out")
Collective = namedtuple("Collective", "kind group where direction values")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    return parser.parse_args(argv)


class OrderedCommDebugMode(CommDebugMode):
    """CommDebugMode counts the collectives per module; this also notes each in `log`, in the order they start."""

    def __init__(self, groups, log):
        super().__init__()
        self.groups, self.log = groups, log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        result = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:
            # Functional collectives (tensor parallel) take (input, ..., group name); c10d's (FSDP2) take
            # (output, input, group, ...).
            functional = isinstance(args[-1], str)
            if functional:
                group, values = args[-1], args[0].numel()
            else:
                group, values = dist.ProcessGroup.unbox(args[2]).group_name, args[1].numel()
            tracker = self.advanced_module_tracker  # the module running now, and whether in backward
            self.log.append(Collective(COLLECTIVES[func._overloadpacket.__name__], self.label(group, functional),
                                       tracker.name.partition(".")[2], "backward" if tracker.is_bw else "forward",
                                       values))
        return result


    def label(self, group, functional):
        """The name that the tables give `group` (a group name); `functional`: a functional collective's."""
        return self.groups[group]


def local(tensor):
    """(the shape that this rank holds, per image; "partial" if the values are partial sums, else "")."""
    kind = "partial" if isinstance(tensor, DTensor) and isinstance(tensor.placements[0], Partial) else ""
    return tuple((tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape[1:]), kind


def measure(rank, tp_size):
    """One training forward and backward of 09's model on this rank: block 0's modules and (rank 0) every
    collective, in order."""
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size // tp_size, tp_size), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = models.VisionTransformer()
    log = []
    # Registered before the plan's own hooks, so they run first: they see what a module receives and returns
    # before the plan redistributes it (a rowwise layer's partial sums, before they are reduce-scattered).
    for name, module in model.blocks[0].named_modules():
        if name and not list(module.children()):
            module.register_forward_pre_hook(lambda module, args: setattr(module, "_input", local(args[0])))
            module.register_forward_hook(lambda module, args, output, name=name: log.append(
                Module(name, *module._input, *local(output))))
    # As 09 does: tensor parallel within the group, then FSDP2 across the replicas.
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], BLOCK_PLAN)
    parallelize_module(model, mesh["tp"], MODEL_PLAN)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    images, labels = torch.randn(BATCH, 3, 32, 32), torch.arange(BATCH)
    groups = {mesh[dim].get_group().group_name: dim for dim in ("dp", "tp")}
    with OrderedCommDebugMode(groups, log) as mode, warnings.catch_warnings():
        # Under CommDebugMode, a dispatch mode, the model's logits come back as a view of a tensor, and FSDP2
        # warns against changing them in place, which this script does not do.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
        with loss_parallel():
            F.cross_entropy(model(images), labels).backward()
    assert mode.get_total_counts() == sum(isinstance(event, Collective) for event in log)
    # The processes hand their results back through a pipe that is read only once all have finished: a large
    # result would block its process. The other ranks' collectives are rank 0's.
    return log if rank == 0 else [event for event in log if isinstance(event, Module)]


def in_block_0(event):
    """Whether a collective started in block 0 or in one of its modules."""
    return event.where == "blocks.0" or event.where.startswith("blocks.0.")


def block_0_forward(log):
    """Block 0's modules and the collectives between them, in the forward pass."""
    return [event for event in log if isinstance(event, Module) or (in_block_0(event) and
                                                                     event.direction == "forward")]


def plan_of(name):
    return PLANS.get(type(BLOCK_PLAN.get(name)), "-")


def shape(dims, kind):
    return " x ".join(map(str, dims)) + (f" {kind}" if kind else "")


def forward_rows(logs):
    """[(module or collective, plan, {tp size: "input -> output"})]: block 0's forward on rank 0. A collective's
    input is the output of the module before it, its output the input of the module after it."""
    rows = []
    for tp_size, log in logs.items():
        events = block_0_forward(log)
        for index, event in enumerate(events):
            if isinstance(event, Module):
                label, plan = event.name, plan_of(event.name)
                text = f"{shape(event.shape_in, event.kind_in)} -> {shape(event.shape_out, event.kind_out)}"
            else:
                label, plan, before, after = event.kind, f"{event.group} group", events[index - 1], events[index + 1]
                text = f"{shape(before.shape_out, before.kind_out)} -> {shape(after.shape_in, after.kind_in)}"
            if len(rows) == index:
                rows.append((label, plan, {}))
            assert rows[index][:2] == (label, plan), "the tp sizes ran different steps"
            rows[index][2][tp_size] = text
    return rows


def backward_rows(log):
    """[[kind, where, values, repeats]]: block 0's collectives in the backward pass, in order, repeats merged."""
    rows = []
    for event in log:
        if isinstance(event, Collective) and event.direction == "backward" and in_block_0(event):
            key = [event.kind, event.where.removeprefix("blocks.0."), event.values]
            if rows and rows[-1][:3] == key:
                rows[-1][3] += 1
            else:
                rows.append([*key, 1])
    return rows


def counts(log):
    """{(group, kind, pass): (how many in block 0, how many in the whole model)}."""
    table = {}
    for event in log:
        if isinstance(event, Collective):
            block, whole = table.get((event.group, event.kind, event.direction), (0, 0))
            table[event.group, event.kind, event.direction] = (block + in_block_0(event), whole + 1)
    return table


def print_step_collectives(logs, layout, groups, kinds, own_group, batch):
    """The context- and expert-parallel figures' table of one training step's collectives: for each run of `logs`
    ({(processes, group size): rank 0's log}, `layout` naming the two sizes, "dp x cp"), each of `groups` and
    `kinds`, how many in block 0 / in the whole model in each pass, and the values that rank 0 puts into
    `own_group`'s per image (`batch` images). FSDP2's collectives move weights and gradients, whose size does not
    depend on the images: no values."""
    print("collectives in one training step, rank 0: in block 0 / in the whole model; values it puts in per image")
    width = len(layout) + 1
    print(f"{layout:<{width}} {'group':<6} {'collective':<15} {'forward':>8} {'backward':>9} {'values':>9}")
    for (processes, size), log in logs.items():
        table = defaultdict(lambda: [0, 0, 0])
        for event in log:
            if isinstance(event, Collective):
                entry = table[event.group, event.kind, event.direction]
                entry[0] += in_block_0(event)
                entry[1] += 1
                entry[2] += event.values
        for group in groups:
            for kind in kinds:
                forward, backward = (table.get((group, kind, direction), [0, 0, 0])
                                     for direction in ("forward", "backward"))
                if forward[1] or backward[1]:
                    values = f"{(forward[2] + backward[2]) // batch:,}" if group == own_group else "-"
                    print(f"{f'{processes // size} x {size}':<{width}} {group:<6} {kind:<15} "
                          f"{f'{forward[0]} / {forward[1]}':>8} {f'{backward[0]} / {backward[1]}':>9} {values:>9}")


def print_tables(logs):
    """logs: {(processes, tp size): rank 0's log}."""
    groups_alone = {tp_size: log for (processes, tp_size), log in logs.items() if processes == tp_size}
    first = min(groups_alone)
    print(f"block 0 forward, rank 0: what the rank holds per image (tokens x features), at tp "
          f"{' and '.join(map(str, groups_alone))}")
    columns = "".join(f"{'tp ' + str(tp):<32}" for tp in groups_alone)
    print(f"{'module or collective':<20} {'plan':<10} {columns}".rstrip())
    for label, plan, texts in forward_rows(groups_alone):
        print(f"{label:<20} {plan:<10} " + "".join(f"{texts[tp]:<32}" for tp in groups_alone).rstrip())
    print()
    print(f"block 0 backward, rank 0, tp {first}: collectives in order, values this rank puts in (batch {BATCH})")
    for kind, where, values, repeats in backward_rows(groups_alone[first]):
        print(f"{kind + (f' x {repeats}' if repeats > 1 else ''):<20} in {where:<20} {values:>7,}")
    print()
    print("collectives in one training step, rank 0: in block 0 / in the whole model")
    print(f"{'dp x tp':<8} {'group':<6} {'collective':<15} {'forward':>8} {'backward':>9}")
    for (processes, tp_size), log in logs.items():
        table = counts(log)
        for group in ("tp", "dp"):
            for kind in ("all-gather", "reduce-scatter", "all-reduce"):
                forward, backward = (table.get((group, kind, direction), (0, 0))
                                     for direction in ("forward", "backward"))
                if forward[1] or backward[1]:
                    print(f"{f'{processes // tp_size} x {tp_size}':<8} {group:<6} {kind:<15} "
                          f"{f'{forward[0]} / {forward[1]}':>8} {f'{backward[0]} / {backward[1]}':>9}")


def picture_rows(log):
    """[(label, plan, Module or Collective)]: block 0's forward, a row per step; query, key and value (alike)
    in one row."""
    rows = []
    for event in block_0_forward(log):
        if isinstance(event, Collective):
            rows.append((event.kind, f"{event.group} group", event))
        elif rows and isinstance(rows[-1][2], Module) and rows[-1][1] == plan_of(event.name) and (
                rows[-1][2][3:] == event[3:]):
            rows[-1] = (f"{rows[-1][0]}, .{event.name.rpartition('.')[2]}", *rows[-1][1:])
        else:
            rows.append((event.name, plan_of(event.name), event))
    return rows


def held(module, plan, rank, tp_size, tokens):
    """What `rank` holds of a module's output: (its tokens, its features, all the features, a label)."""
    local_tokens, local_features = module.shape_out
    features = local_features * tp_size if plan == "colwise" else local_features
    if module.kind_out == "partial":
        return (0, tokens), (0, features), features, f"partial sums: {tokens} tokens x {features}"
    if local_tokens < tokens:
        start = rank * local_tokens
        return ((start, start + local_tokens), (0, features), features,
                f"tokens {start}-{start + local_tokens - 1} x {features}")
    start = rank * local_features
    if module.name.startswith("attention."):
        head_width = features // models.VIT_HEADS
        what = f"heads {start // head_width}-{(start + local_features) // head_width - 1} of {models.VIT_HEADS}"
    else:
        what = f"hidden {start}-{start + local_features - 1} of {features}"
    return (0, tokens), (start, start + local_features), features, f"{tokens} tokens x {what}"


def draw(logs, tp_size, output):
    """Block 0's forward at `tp_size`, from each rank's log: a row per module or collective, a column per rank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    rows = picture_rows(logs[0])
    # The other ranks log their modules alone: their rows are rank 0's without the collectives.
    modules = [[row for row in picture_rows(logs[rank]) if isinstance(row[2], Module)] for rank in range(tp_size)]
    tokens = max(event.shape_out[0] for _, _, event in rows if isinstance(event, Module))
    column, width, height = 3.0, 2.2, 0.46  # a box: one image's activation, tokens across and features down
    colours = {"tokens": "#5b8fd1", "features": "#f2a65a", "collective": "#7a3b8f"}
    figure, axis = plt.subplots(figsize=(3.4 + 2.4 * tp_size, 0.6 * len(rows) + 1.6))
    module_index = 0
    for index, (label, plan, event) in enumerate(rows):
        y = -index
        if isinstance(event, Collective):
            axis.add_patch(FancyArrowPatch((0.1, y), (column * tp_size - 0.1, y), arrowstyle="<|-|>",
                                           mutation_scale=10, color=colours["collective"], lw=1.2))
            axis.text(column * tp_size / 2, y + 0.06, f"{event.kind}   (in backward: {MIRROR[event.kind]})",
                      ha="center", va="bottom", fontsize=9, color=colours["collective"], weight="bold")
            axis.text(-0.2, y, plan, ha="right", va="center", fontsize=9, color=colours["collective"])
            continue
        second = {"sequence": "sequence parallel", "colwise": "colwise parallel",
                  "rowwise": "rowwise parallel"}.get(plan, "its own mask, then + residual")
        axis.text(-0.2, y, f"{label}\n{second}", ha="right", va="center", fontsize=9)
        for rank in range(tp_size):
            rank_label, _, module = modules[rank][module_index]
            assert rank_label == label, "the ranks ran different modules"
            (t0, t1), (f0, f1), features, text = held(module, plan, rank, tp_size, tokens)
            x = column * rank + (column - width) / 2
            partial = module.kind_out == "partial"
            axis.add_patch(Rectangle((x, y - height / 2), width, height, fill=False, edgecolor="#888888", lw=0.8))
            axis.add_patch(Rectangle((x + width * t0 / tokens, y + height / 2 - height * f1 / features),
                                     width * (t1 - t0) / tokens, height * (f1 - f0) / features, lw=0,
                                     facecolor=colours["tokens" if t1 - t0 < tokens else "features"],
                                     edgecolor="white" if partial else "none", hatch="////" if partial else None))
            axis.text(x + width / 2, y - height / 2 - 0.03, text, ha="center", va="top", fontsize=7.5)
        module_index += 1
    for rank in range(tp_size):
        axis.text(column * rank + column / 2, 0.6, f"rank {rank}", ha="center", fontsize=10, weight="bold")
    axis.legend(handles=[Patch(color=colours["tokens"], label="a slice of the tokens, all features"),
                         Patch(color=colours["features"], label="all tokens, a slice of the features"),
                         Patch(facecolor=colours["features"], hatch="////", edgecolor="white",
                               label="all tokens and features, partial sums")],
                loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize=8, frameon=False)
    axis.set_title(f"Block 0 of step 09's vision transformer at tp {tp_size}, forward: what each rank holds after "
                   f"each module\n(a box is one image's activation: its {tokens} tokens across, its features down)",
                   fontsize=10)
    axis.set_xlim(-2.7, column * tp_size)
    axis.set_ylim(-len(rows) + 0.4, 0.95)
    axis.axis("off")
    figure.tight_layout()
    figure.savefig(output, dpi=100)


def _measure_at(measure, size, rank):
    return measure(rank, size)


def measure_print_and_draw(args, measure, runs, print_tables, draw):
    """This figure's main, and benchmarks/context_parallel_figure.py's: `measure(rank, group size)` in each run of
    `runs`, (processes, group size); the tables of rank 0's logs; the picture of the first run, to `args.output`."""
    logs = {(processes, size): launch.in_local_processes(functools.partial(_measure_at, measure, size), processes,
                                                         TIMEOUT)
            for processes, size in runs}
    print_tables({run: per_rank[0] for run, per_rank in logs.items()})
    draw(logs[runs[0]], runs[0][1], args.output)
    print(f"wrote {args.output}")


def main():
    measure_print_and_draw(parse_args(), measure, RUNS, print_tables, draw)


if __name__ == "__main__":
    main()
