"""What each rank of a context-parallel group holds, and where the collectives run: step 10's hooks, measured.

    python benchmarks/context_parallel_figure.py --output docs/context-parallel.png

Starts processes on this machine (torch.multiprocessing, gloo on 127.0.0.1, no GPU needed): 2 (cp 2), then 4
(cp 4), then 4 again (2 replicas of cp 2). Each builds models.VisionTransformer with step 10's hooks, shards it
with FSDP2 over every rank as 10 does, and runs one training forward and backward. Torch's CommDebugMode sees
every collective and the module that was running when it started; forward hooks record what each module of
block 0 receives and returns. The first table follows block 0 on rank 0 through the forward pass, with the
collectives where they run; the second counts one step's collectives, in block 0 and in the whole model, with
the values that rank 0 puts into each kind per image. The picture draws block 0 at cp 2: which tokens each rank
holds after each module, and the collectives that join the ranks.
"""

import argparse
import sys
import warnings
from pathlib import Path

import launch
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from tensor_parallel_figure import (
    Collective,
    Module,
    OrderedCommDebugMode,
    in_block_0,
    local,
    measure_print_and_draw,
    print_step_collectives,
    shape,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(launch.ROOT))  # common/ is beside benchmarks/
from common import models  # noqa: E402

# (processes, cp size): a group of 2, a group of 4, and 2 replicas of a group of 2.
RUNS = ((2, 2), (4, 4), (4, 2))
BATCH = 2  # images per replica: the shapes and values are per image, and the counts do not depend on it


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    return parser.parse_args(argv)


class ContextParallelCommDebugMode(OrderedCommDebugMode):
    """Step 10's own collectives are functional ones (its all-gathers, and their backward), FSDP2's are c10d's: in a
    world of one group, both run in the default process group, and only the kind of call tells them apart."""

    def label(self, group, functional):
        return "cp" if functional else self.groups[group]


def context_parallel(model, mesh):
    """Step 10's hooks, copied: the step shows them in full (they are the lesson), and a benchmark never imports
    a step. tests/test_docs.py checks that the copies stay the same."""
    cp_rank, cp_size = mesh.get_local_rank("cp"), mesh["cp"].size()

    def keep_own_tokens(module, inputs, tokens):
        return tokens.chunk(cp_size, dim=1)[cp_rank].contiguous()

    def all_tokens(module, inputs, tokens):
        return funcol.all_gather_single(tokens, 1, mesh["cp"])

    model.embedding.register_forward_hook(keep_own_tokens)
    for block in model.blocks:
        block.attention.key.register_forward_hook(all_tokens)
        block.attention.value.register_forward_hook(all_tokens)
    model.head.register_forward_pre_hook(lambda head, inputs: all_tokens(head, inputs, *inputs))


def measure(rank, cp_size):
    """One training forward and backward of 10's model on this rank: block 0's modules and (rank 0) every
    collective, in order."""
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size // cp_size, cp_size), mesh_dim_names=("dp", "cp"))
    everyone = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = models.VisionTransformer()
    log = []
    # Registered before step 10's hooks, so they run first: a key's or value's own tokens, before the gather.
    for name, module in model.blocks[0].named_modules():
        if name and not list(module.children()):
            module.register_forward_pre_hook(lambda module, args: setattr(module, "_input", local(args[0])))
            module.register_forward_hook(lambda module, args, output, name=name: log.append(
                Module(name, *module._input, *local(output))))
    context_parallel(model, mesh)
    for block in model.blocks:
        fully_shard(block, mesh=everyone)
    fully_shard(model, mesh=everyone)
    # Each replica's images; the ranks of a group see the same ones.
    generator = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
    images, labels = torch.randn(BATCH, 3, 32, 32, generator=generator), torch.arange(BATCH)
    groups = {mesh["dp"].get_group().group_name: "dp", everyone.get_group().group_name: "all"}
    with ContextParallelCommDebugMode(groups, log) as mode, warnings.catch_warnings():
        # Under CommDebugMode, a dispatch mode, the model's logits come back as a view of a tensor, and FSDP2
        # warns against changing them in place, which this script does not do.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
        F.cross_entropy(model(images), labels).backward()
    assert mode.get_total_counts() == sum(isinstance(event, Collective) for event in log)
    return log if rank == 0 else [event for event in log if isinstance(event, Module)]


def block_0_forward(log):
    """Block 0's modules and, after the key and the value, their gathers, in the forward pass. Step 10's gather
    runs in the module's forward hook, after torch's module tracker has left the module: it files the gather under
    the attention module, the key's and value's parent."""
    return [event for event in log if isinstance(event, Module) or (
        in_block_0(event) and event.direction == "forward" and event.group == "cp")]


def forward_rows(logs):
    """[(module or collective, {cp size: "input -> output"})]: block 0's forward on rank 0."""
    rows = []
    for cp_size, log in logs.items():
        events = block_0_forward(log)
        for index, event in enumerate(events):
            if isinstance(event, Module):
                label = event.name
                text = f"{shape(event.shape_in, event.kind_in)} -> {shape(event.shape_out, event.kind_out)}"
            else:
                tokens, features = events[index - 1].shape_out
                label, text = f"{event.kind} (cp)", f"{tokens} x {features} -> {tokens * cp_size} x {features}"
            if len(rows) == index:
                rows.append((label, {}))
            assert rows[index][0] == label, "the cp sizes ran different steps"
            rows[index][1][cp_size] = text
    return rows


def print_tables(logs):
    """logs: {(processes, cp size): rank 0's log}."""
    groups_alone = {cp_size: log for (processes, cp_size), log in logs.items() if processes == cp_size}
    print(f"block 0 forward, rank 0: what the rank holds per image (tokens x features), at cp "
          f"{' and '.join(map(str, groups_alone))}")
    print(f"{'module or collective':<22} " + "".join(f"{'cp ' + str(cp):<26}" for cp in groups_alone).rstrip())
    for label, texts in forward_rows(groups_alone):
        print(f"{label:<22} " + "".join(f"{texts[cp]:<26}" for cp in groups_alone).rstrip())
    print()
    print_step_collectives(logs, "dp x cp", ("cp", "dp", "all"), ("all-gather", "reduce-scatter", "all-reduce"),
                           "cp", BATCH)


def draw(logs, cp_size, output):
    """Block 0's forward at `cp_size`, from each rank's log: a row per module or gather, a column per rank, a
    box per image's activation with the tokens that the rank holds filled in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

    events = block_0_forward(logs[0])
    modules = [[event for event in block_0_forward(logs[rank]) if isinstance(event, Module)] for rank in range(cp_size)]
    tokens = cp_size * events[0].shape_in[0]
    # A row per module, and after each gather a row for what it gathered (the key's or value's of every token).
    rows = []
    for event in events:
        rows += [event, ("gathered", rows[-1])] if isinstance(event, Collective) else [event]
    column, width, height = 3.0, 2.2, 0.42
    colours = {"own": "#5b8fd1", "all": "#f2a65a", "collective": "#7a3b8f"}
    figure, axis = plt.subplots(figsize=(3.4 + 2.4 * cp_size, 0.55 * len(rows) + 1.6))
    module_index = 0
    for index, row in enumerate(rows):
        y = -index
        if isinstance(row, Collective):
            axis.add_patch(FancyArrowPatch((0.1, y), (column * cp_size - 0.1, y), arrowstyle="<|-|>",
                                           mutation_scale=10, color=colours["collective"], lw=1.2))
            axis.text(column * cp_size / 2, y + 0.06, "all-gather of the tokens   (in backward: reduce-scatter)",
                      ha="center", va="bottom", fontsize=9, color=colours["collective"], weight="bold")
            axis.text(-0.2, y, "cp group", ha="right", va="center", fontsize=9, color=colours["collective"])
            continue
        if isinstance(row, tuple) and row[0] == "gathered":
            label, cells = f"{row[1].name.rpartition('.')[2]}s of every token", [(0, tokens)] * cp_size
            texts = [f"{tokens} x {row[1].shape_out[1]}"] * cp_size
        else:
            label, held = row.name, [modules[rank][module_index] for rank in range(cp_size)]
            assert all(module.name == row.name for module in held), "the ranks ran different modules"
            cells = [(rank * module.shape_out[0], module.shape_out[0]) for rank, module in enumerate(held)]
            texts = [shape(module.shape_out, module.kind_out) for module in held]
            module_index += 1
        axis.text(-0.2, y, label, ha="right", va="center", fontsize=9)
        for rank, ((start, count), text) in enumerate(zip(cells, texts, strict=True)):
            x = column * rank + (column - width) / 2
            axis.add_patch(Rectangle((x, y - height / 2), width, height, fill=False, edgecolor="#888888", lw=0.8))
            axis.add_patch(Rectangle((x + width * start / tokens, y - height / 2), width * count / tokens, height,
                                     lw=0, facecolor=colours["own" if count < tokens else "all"]))
            axis.text(x + width / 2, y - height / 2 - 0.03, text, ha="center", va="top", fontsize=7.5)
    for rank in range(cp_size):
        axis.text(column * rank + column / 2, 0.6, f"rank {rank}", ha="center", fontsize=10, weight="bold")
    axis.legend(handles=[Patch(color=colours["own"], label="the rank's own tokens"),
                         Patch(color=colours["all"], label="every token of the image")],
                loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=2, fontsize=8, frameon=False)
    axis.set_title(f"Block 0 of step 10's vision transformer at cp {cp_size}, forward: the tokens each rank holds "
                   f"after each module\n(a box is one image's activation, its {tokens} tokens across)", fontsize=10)
    axis.set_xlim(-2.7, column * cp_size)
    axis.set_ylim(-len(rows) + 0.4, 0.95)
    axis.axis("off")
    figure.tight_layout()
    figure.savefig(output, dpi=100)


def main():
    measure_print_and_draw(parse_args(), measure, RUNS, print_tables, draw)


if __name__ == "__main__":
    main()
