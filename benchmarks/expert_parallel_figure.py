"""Where an expert-parallel group sends the tokens, and which collectives it runs: step 11's all-to-alls, measured.

    python benchmarks/expert_parallel_figure.py --output docs/expert-parallel.png

Starts processes on this machine (torch.multiprocessing, gloo on 127.0.0.1, no GPU needed): 2 (ep 2), then 4
(ep 4), then 4 again (2 copies of ep 2). Each builds models.VisionTransformer with 8 experts per block, top-2, with
step 11's expert parallelism, shards it with FSDP2 as 11 does, and runs one training forward and backward on
images of its own, in float64 (so that the routing does not depend on the CPU's rounding). Torch's CommDebugMode
sees every collective and the module that was running when it started; block 0's mixture reports how many of its
rank's tokens the router sent to each expert. The first table gives block 0's routing at ep 2 on every rank; the
second counts one step's collectives, in block 0 and in the whole model, with the values that rank 0 puts into
each kind per image. The picture draws block 0's routing at ep 2: the tokens
that each rank sent to each expert, and the ranks that hold them.
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
from tensor_parallel_figure import OrderedCommDebugMode, measure_print_and_draw, print_step_collectives
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

sys.path.insert(0, str(launch.ROOT))  # common/ is beside benchmarks/
from common import models  # noqa: E402

# (processes, ep size): a group of 2, a group of 4, and 2 copies of a group of 2.
RUNS = ((2, 2), (4, 4), (4, 2))
EXPERTS, TOP_K = 8, 2  # step 11's defaults
BATCH = 2  # images per rank: the values are per image, and the counts of collectives do not depend on it
KINDS = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", type=Path, required=True, help="the PNG to write")
    return parser.parse_args(argv)


class ExpertParallelCommDebugMode(OrderedCommDebugMode):
    """Step 11's own collectives are functional ones (its all-to-alls, and their backward), FSDP2's are c10d's: in
    a world of one group, both can run in the default process group, and only the kind of call tells them apart."""

    def label(self, group, functional):
        return "ep" if functional else self.groups[group]


def expert_parallel(model, mesh):
    """Step 11's expert parallelism, copied: the step shows it in full (it is the lesson), and a benchmark never
    imports a step. tests/test_docs.py checks that the copies stay the same."""

    def hold_own_experts(name, experts, ep):
        for key, w in experts.named_parameters(recurse=False):
            setattr(experts, key, torch.nn.Parameter(distribute_tensor(w, ep, [Shard(0)])))

    def send_to_experts(experts, inputs, ep):
        tokens, counts = inputs
        received = funcol.all_to_all_single(counts, None, None, ep)
        sent, received = torch.stack([counts, received]).view(2, ep.size(), -1).cpu()
        experts.splits = sent.sum(1).tolist(), received.sum(1).tolist()
        tokens = funcol.all_to_all_single_autograd(tokens, *experts.splits[::-1], ep)
        return tokens, received

    def send_back(experts, outputs, ep):
        return funcol.all_to_all_single_autograd(outputs, *experts.splits, ep)

    for block in model.blocks:
        distribute_module(block.mlp.experts, mesh["ep"], hold_own_experts,
                          send_to_experts, send_back)


def measure(rank, ep_size):
    """One training forward and backward of 11's model on this rank. Rank 0 returns every collective, in order,
    and every rank's routing in block 0 (the tokens it sent to each expert); the others return nothing."""
    world_size = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size // ep_size, ep_size), mesh_dim_names=("edp", "ep"))
    everyone = init_device_mesh("cpu", (world_size,))
    # In float64: the routing, a top-k of the router's probabilities, must not depend on the CPU's rounding.
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    model = models.VisionTransformer(experts=EXPERTS, top_k=TOP_K)
    expert_parallel(model, mesh)
    for block in model.blocks:  # as 11 does, without its hook's division, which moves no value
        fully_shard(block.mlp.experts, mesh=mesh["edp"])
        fully_shard(block, mesh=everyone)
    fully_shard(model, mesh=everyone)
    # Every rank's own images.
    generator = torch.Generator().manual_seed(rank)
    images, labels = torch.randn(BATCH, 3, 32, 32, generator=generator), torch.arange(BATCH)
    groups = {mesh["edp"].get_group().group_name: "edp", everyone.get_group().group_name: "all"}
    log = []
    with ExpertParallelCommDebugMode(groups, log) as mode, warnings.catch_warnings():
        # Under CommDebugMode, a dispatch mode, the model's logits come back as a view of a tensor, and FSDP2
        # warns against changing them in place, which this script does not do.
        warnings.filterwarnings("ignore", "FSDP2-wrapped module", UserWarning)
        F.cross_entropy(model(images), labels).backward()
    assert mode.get_total_counts() == len(log)
    routed = [None] * world_size
    dist.all_gather_object(routed, model.blocks[0].mlp.tokens_per_expert.tolist())
    return {"log": log, "routed": routed} if rank == 0 else None


def print_tables(results):
    """results: {(processes, ep size): rank 0's result}."""
    routed = results[RUNS[0]]["routed"]
    ep_size = RUNS[0][1]
    local = EXPERTS // ep_size
    print(f"block 0 at ep {ep_size}: tokens that each rank's router sent to each expert ({BATCH} images of 64 tokens, "
          f"top-{TOP_K}: {BATCH * 64 * TOP_K} per rank)")
    print(f"{'from':<8} " + " ".join(f"{'e' + str(expert):>5}" for expert in range(EXPERTS)) + "  "
          + " ".join(f"{'to rank ' + str(rank):>10}" for rank in range(ep_size)))
    for rank, per_expert in enumerate(routed):
        to_ranks = [sum(per_expert[rank_ * local:(rank_ + 1) * local]) for rank_ in range(ep_size)]
        print(f"{'rank ' + str(rank):<8} " + " ".join(f"{count:>5}" for count in per_expert) + "  "
              + " ".join(f"{count:>10}" for count in to_ranks))
    print()
    print_step_collectives({run: result["log"] for run, result in results.items()}, "copies x ep",
                           ("ep", "edp", "all"), KINDS, "ep", BATCH)


def draw(results, ep_size, output):
    """Block 0's routing at `ep_size`: a row per expert, grouped by the rank that holds it, a bar of the tokens it
    received, coloured by the rank that sent them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    routed = results[0]["routed"]
    local = EXPERTS // ep_size
    colours = ["#5b8fd1", "#f2a65a", "#6aa84f", "#c0504d"]
    figure, axis = plt.subplots(figsize=(9, 0.42 * EXPERTS + 2.6))
    for expert in range(EXPERTS):
        y = -(expert + expert // local * 0.6)  # a gap between the ranks' experts
        left = 0
        for source, per_expert in enumerate(routed):
            count = per_expert[expert]
            axis.barh(y, count, left=left, height=0.7, color=colours[source], edgecolor="white", lw=0.5)
            if count:
                axis.text(left + count / 2, y, str(count), ha="center", va="center", fontsize=7.5, color="white")
            left += count
        axis.text(-4, y, f"expert {expert}", ha="right", va="center", fontsize=9)
        if expert % local == 0:
            axis.text(-52, y - (local - 1) / 2, f"rank {expert // local}", ha="right", va="center", fontsize=10,
                      weight="bold")
    handles = [Patch(color=colours[source], label=f"from rank {source}'s images: "
                     f"{sum(routed[source][source * local:(source + 1) * local])} of its {sum(routed[source])} "
                     f"assignments stay on it, the all-to-all carries the rest") for source in range(ep_size)]
    figure.legend(handles=handles, loc="lower center", fontsize=8, frameon=False)
    figure.suptitle(f"Block 0 of step 11's mixture of experts at ep {ep_size}, one training step:\nthe tokens "
                   f"that each expert received ({BATCH} images of 64 tokens per rank, each token routed to "
                   f"{TOP_K} of the {EXPERTS} experts)", fontsize=10)
    axis.set_xlabel("tokens", fontsize=9)
    axis.set_yticks([])
    for side in ("left", "right", "top"):
        axis.spines[side].set_visible(False)
    figure.tight_layout(rect=(0, 0.08, 1, 1))
    figure.savefig(output, dpi=100)


def main():
    measure_print_and_draw(parse_args(), measure, RUNS, print_tables, draw)


if __name__ == "__main__":
    main()
