"""What sharding saves, measured per rank: the bytes of parameters, gradients and optimizer state that each
process holds under DDP (04), DeepSpeed's ZeRO-0 to 3 (05), FSDP2 (07), pipeline (08), tensor parallelism (09),
context parallelism (10) and expert parallelism (11).

    python benchmarks/memory.py --json runs/memory.json --output docs/memory.png   # the table in docs/memory.md
    python benchmarks/memory.py --methods DDP ZeRO-2 --world-sizes 2               # some of it

Each method's real step runs under torchrun (gloo on CPUs, NCCL on GPUs) at each world size, on the synthetic data,
in fp32, with a global batch of 24, behind this file (`--worker`), which adds hooks that PyTorch calls for every
torch optimizer (DeepSpeed's inner one too; 07 steps a plain one over FSDP2's shards) and every module. At the
second optimizer step, when the first step's optimizer state exists and the second step's gradients are ready, each
rank counts the tensors it holds, each storage once: the model's parameters as this rank holds them (its shard of a
DTensor, its partition of a ZeRO-3 parameter), their gradients, and the optimizer's state. DeepSpeed's optimizer
updates an fp32 copy of this rank's partition of the weights (master weights): counted with the optimizer state, as
the ZeRO paper counts it, and reported apart too. Every other tensor that DeepSpeed's engine holds (reduce buckets,
gradient partitions) is counted as a buffer, by the attribute that holds it; DDP's gradient buckets, as DDP reports
them. The peak is the most memory in tensors during the second step, from the end of the first optimizer step to the
end of the second: torch.cuda.max_memory_allocated on a GPU; on a CPU, PyTorch's FSDPMemTracker (07, 09-11) or
MemTracker (the others), which follow the tensors counted above and every tensor that the step creates or touches.

It prints a table, writes one record per method, world size and rank with --json, and draws the bytes per rank
against the number of processes with --output, beside the ZeRO paper's formula for this model (docs/memory.md).
"""

import argparse
import datetime
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import launch
import torch
import torch.distributed as dist
from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
from torch.distributed._tools.mem_tracker import MemTracker
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

sys.path.insert(0, str(launch.ROOT))  # common/ is beside benchmarks/
from common import models  # noqa: E402

# The optimizer step at which each rank counts what it holds: the first step's optimizer state, the second's gradients.
MEASURED_STEP = 2
# Every run: the synthetic data, fp32 (no --amp), a global batch that 1, 2 and 4 processes divide; it ends at the
# measured step.
RUN_ARGS = ["--synthetic", "--num-workers", "0", "--batch-size", "24", "--lr", "0.1", "--epochs", "1",
            "--max-steps", str(MEASURED_STEP + 1)]
# method: (step, its own arguments, ZeRO stage). 08 runs one pipeline stage per process; 09 its default mesh,
# tensor-parallel groups of 2 (1 alone), which FSDP2 shards across the replicas (2 at 4 processes); 10 one
# context-parallel group of every process (what a rank holds as C grows), with FSDP2 over every rank; 11 one
# expert-parallel group of every process (E / N experts each), the rest sharded by FSDP2 over every rank.
METHODS = {
    "DDP": ("04", [], None),
    **{f"ZeRO-{stage}": ("05", ["--zero-stage", str(stage)], stage) for stage in range(4)},
    "FSDP2": ("07", [], None),
    "pipeline": ("08", [], None),
    "tensor parallel": ("09", [], None),
    "context parallel": ("10", ["--cp-size", "{world_size}"], None),
    "expert parallel": ("11", ["--ep-size", "{world_size}"], None),
}
WORLD_SIZES = [1, 2, 4]
# The model each step trains, as it builds it by default: Ψ of the formula.
PARAMETERS = {name: sum(parameter.numel() for parameter in model.parameters())
              for name, model in (("ResNet-9", models.ResNet9()), ("ViT", models.VisionTransformer()),
                                  ("ViT-MoE", models.VisionTransformer(experts=8, top_k=2)))}
FP32 = 4  # bytes per weight and per gradient: every run is fp32
# K, the optimizer's bytes per parameter: SGD's momentum buffer; AdamW's two moments (09-11); under DeepSpeed's ZeRO-1
# to 3, the momentum and the fp32 copy of the weights that its optimizer updates (the ZeRO paper counts that copy
# in K: 12 for mixed-precision Adam).
MOMENTUM_K = 4
ADAMW_K = 8
DEEPSPEED_K = 8
MB = 1e6
# Ψ and K, as the table and the picture state them.
SIZES = (f"Ψ = {PARAMETERS['ResNet-9']:,} (ResNet-9), {PARAMETERS['ViT']:,} (the vision transformer of 09 and 10), "
         f"{PARAMETERS['ViT-MoE']:,} (11's, 8 experts per block); K = {MOMENTUM_K} (SGD's momentum), {ADAMW_K} for "
         f"AdamW (09-11: two moments) and under ZeRO-1 to 3")
LAUNCH_TIMEOUT = 600  # seconds for one method at one world size (DeepSpeed at 4 processes: about 40 s on 2 cores)
SMALL = 1000  # bytes: the buffers listed by name are those of this size or more (the rest are scalars)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS), help="only these")
    parser.add_argument("--world-sizes", nargs="+", type=int, choices=WORLD_SIZES, default=WORLD_SIZES,
                        help="numbers of processes")
    parser.add_argument("--json", type=Path, help="write one record per method, world size and rank here")
    parser.add_argument("--output", type=Path, help="draw the picture here (PNG)")
    return parser.parse_args(argv)


def model_of(method):
    return {"tensor parallel": "ViT", "context parallel": "ViT", "expert parallel": "ViT-MoE"}.get(method, "ResNet-9")


def optimizer_k(method):
    if model_of(method) != "ResNet-9":
        return ADAMW_K
    return DEEPSPEED_K if method in ("ZeRO-1", "ZeRO-2", "ZeRO-3") else MOMENTUM_K


def formula_bytes(method, world_size):
    """The ZeRO paper's bytes per device (its Table 1) for this model in fp32: (4 + 4 + K)·Ψ replicated,
    (4 + 4 + K/N)·Ψ, (4 + (4 + K)/N)·Ψ and (4 + 4 + K)·Ψ/N for ZeRO-1, 2 and 3. FSDP2 shards as ZeRO-3; for
    08-11, (4 + 4 + K)·Ψ/N is what an even split of every weight would give."""
    psi = PARAMETERS[model_of(method)]
    k, n = optimizer_k(method), world_size
    per_parameter = {"DDP": FP32 + FP32 + k, "ZeRO-0": FP32 + FP32 + k, "ZeRO-1": FP32 + FP32 + k / n,
                     "ZeRO-2": FP32 + (FP32 + k) / n}.get(method, (FP32 + FP32 + k) / n)
    return round(per_parameter * psi)


# ---------------------------------------------------------------------------------------------------------------
# In each worker process: count what this rank holds.


def held(tensor):
    """The tensors that hold `tensor`'s values on this rank: a DTensor's local shard; a ZeRO-3 parameter's
    partition (ds_tensor) beside the parameter (empty while partitioned, whole while gathered)."""
    if tensor is None:
        return []
    if isinstance(tensor, DTensor):
        return [tensor._local_tensor]
    return [tensor, *([tensor.ds_tensor] if hasattr(tensor, "ds_tensor") else [])]


class Storages:
    """Bytes per kind, each storage counted once, by the first kind that claims it. A storage's bytes, not a
    tensor's: ZeRO-1 and 2 keep the weights as views of one flat buffer, FSDP2 pads its shards to equal sizes, and
    what is allocated is the buffer, padding included."""

    def __init__(self):
        self.seen = set()
        self.bytes = {}
        self.tensors = []

    def add(self, kind, tensors):
        self.bytes.setdefault(kind, 0)
        for tensor in tensors:
            for part in held(tensor):
                storage = part.untyped_storage()
                # Meta tensors (DeepSpeed keeps some as shapes) hold no memory.
                if part.device.type == "meta" or not storage.nbytes() or storage.data_ptr() in self.seen:
                    continue
                self.seen.add(storage.data_ptr())
                self.bytes[kind] += storage.nbytes()
                self.tensors.append(part)


def is_deepspeed_object(obj):
    return type(obj).__module__.startswith("deepspeed.")


def tensors_held_by(root, name):
    """(path, tensor) for every tensor reachable from `root` through containers and DeepSpeed's objects, shortest
    paths first; indices and keys left out of the paths."""
    found, seen, level = [], set(), [(root, name)]
    while level:  # breadth first: the first path to a tensor is a shortest one
        next_level = []
        for obj, path in level:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, torch.Tensor):
                found.append((path, obj))
            elif isinstance(obj, dict):
                next_level += [(value, path) for value in obj.values()]
            elif isinstance(obj, (list, tuple, set)):
                next_level += [(value, path) for value in obj]
            elif is_deepspeed_object(obj) and hasattr(obj, "__dict__"):
                # Name-mangled private attributes (_Class__name) by their own name.
                next_level += [(value, f"{path}.{re.sub(r'^_[A-Za-z0-9]+__', '', key)}")
                               for key, value in vars(obj).items()]
        level = next_level
    return found


def count_held(model, optimizer):
    """(counts, tensors): {kind: bytes} of what this rank holds now, and every tensor counted.
    `model` is the outermost module that the step calls; `optimizer`, the torch optimizer that steps."""
    storages = Storages()
    parameters = list(model.parameters())
    optimized = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    storages.add("parameter_bytes", parameters)
    storages.add("gradient_bytes", [parameter.grad for parameter in [*parameters, *optimized]])
    storages.add("momentum_bytes", [value for state in optimizer.state.values() for value in state.values()
                                    if isinstance(value, torch.Tensor)])
    # What the optimizer updates where it is not the model's weights: DeepSpeed's fp32 partition.
    storages.add("master_weight_bytes", optimized)
    storages.add("model_buffers", model.buffers())  # BatchNorm's statistics (9 KB in ResNet-9): not counted
    counts = {kind: storages.bytes[kind] for kind in ("parameter_bytes", "gradient_bytes", "master_weight_bytes")}
    counts["optimizer_bytes"] = storages.bytes["momentum_bytes"] + storages.bytes["master_weight_bytes"]
    counts["buffers"] = None
    if is_deepspeed_object(model):
        counts["buffers"] = {}
        for path, tensor in tensors_held_by(model, "engine"):
            before = storages.bytes.get("buffer_bytes", 0)
            storages.add("buffer_bytes", [tensor])
            if storages.bytes["buffer_bytes"] > before:
                counts["buffers"][path] = counts["buffers"].get(path, 0) + storages.bytes["buffer_bytes"] - before
    elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
        # DDP reduces the gradients in buckets of its own (in C++, out of Python's reach): their sizes as it reports.
        sizes = model._get_ddp_logging_data()["bucket_sizes"]
        counts["buffers"] = {"DDP's gradient buckets": sum(map(int, sizes.split(",")))}
    counts["buffer_bytes"] = None if counts["buffers"] is None else sum(counts["buffers"].values())
    return counts, storages.tensors


class TotalMemTracker(MemTracker):
    """MemTracker's total alone: its statistics per module refuse a module that runs twice in a step (08's stages
    run once per micro-batch), and the peak of the total needs none of them."""

    def _pre_fw_hook(self, module, inputs):
        pass

    def _post_fw_hook(self, module, inputs, outputs):
        pass

    def _pre_bw_hook(self, module, args):
        pass

    def _post_bw_hook(self, module, args):
        pass


class PeakTracker:
    """The most bytes in tensors between `start` and `stop`."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.tracker, self.name = None, None  # set by start()

    def start(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.name = "torch.cuda.max_memory_allocated"
            return
        if isinstance(self.model, FSDPModule):
            self.tracker, self.name = FSDPMemTracker(self.model, self.optimizer), "FSDPMemTracker"
        else:
            self.tracker, self.name = TotalMemTracker(), "MemTracker"
        # Besides what the step creates or touches: everything this rank holds already.
        self.tracker.track_external(*count_held(self.model, self.optimizer)[1])
        self.tracker.__enter__()

    def stop(self):
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated()
        self.tracker.__exit__(None, None, None)
        return sum(device["Total"] for device in self.tracker.get_tracker_snapshot("peak").values())


class BuildPeak:
    """The most bytes in tensors from the moment the step starts building its model to the moment it builds its
    optimizer (every step wraps or shards the model before; 05 hands both to DeepSpeed after), beyond what the
    process held before: torch.cuda.max_memory_allocated on a GPU, MemTracker's total on a CPU (the meta device's
    shapes left out). The optimizer, not the first forward pass: MemTracker's module hooks, active in 08's first
    pass, would break the backward pass by which the pipeline infers its shapes."""

    def __init__(self):
        self.tracker, self.before = None, 0

    def start(self):
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
            self.before = torch.cuda.memory_allocated()
        else:
            self.tracker = TotalMemTracker()
            self.tracker.__enter__()

    def stop(self):
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() - self.before
        self.tracker.__exit__(None, None, None)
        peaks = self.tracker.get_tracker_snapshot("peak")
        return sum(peak["Total"] for device, peak in peaks.items() if torch.device(device).type != "meta")


def measure_in_this_process(output_dir, argv):
    """Run the step that `argv` names in this process; at its MEASURED_STEP-th optimizer step, write this rank's
    counts into `output_dir`, then end, with every other rank."""
    found = {"steps": 0}

    def building(init):
        def build(model, *args, **kwargs):
            if "build" not in found:  # the first model built: on the meta device in 07, 09 and 10
                found["build"] = BuildPeak()
                found["build"].start()
            init(model, *args, **kwargs)
        return build

    def built(init):
        def build_optimizer(optimizer, *args, **kwargs):
            if "build_peak_bytes" not in found:
                found["build_peak_bytes"] = found["build"].stop()
            init(optimizer, *args, **kwargs)
        return build_optimizer

    def first_module(module, args):
        # The first module that a step calls is its whole model: DDP, DeepSpeed's engine, the FSDP2 root, 08's stage,
        # the model of 09 and 10.
        found.setdefault("model", module)

    def before_step(optimizer, args, kwargs):
        found["steps"] += 1
        if found["steps"] == MEASURED_STEP:
            found["counts"], _ = count_held(found["model"], optimizer)

    def after_step(optimizer, args, kwargs):
        if found["steps"] == MEASURED_STEP - 1:
            found["peak"] = PeakTracker(found["model"], optimizer)
            found["peak"].start()
        elif found["steps"] == MEASURED_STEP:
            record = {**found["counts"], "peak_bytes": found["peak"].stop(), "peak_measured_by": found["peak"].name,
                      "build_peak_bytes": found["build_peak_bytes"], "rank": dist.get_rank()}
            (Path(output_dir) / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
            # The rest of the run (evaluation, checkpoints) is not measured. Every rank ends here, after this step.
            dist.barrier()
            os._exit(0)

    for model_class in (models.ResNet9, models.VisionTransformer):
        model_class.__init__ = building(model_class.__init__)
    torch.optim.Optimizer.__init__ = built(torch.optim.Optimizer.__init__)
    register_module_forward_pre_hook(first_module)
    register_optimizer_step_pre_hook(before_step)
    register_optimizer_step_post_hook(after_step)
    launch.run_step_here(argv)


# ---------------------------------------------------------------------------------------------------------------
# In the benchmark's process: run the steps, then the table and the picture.


def measure(method, world_size):
    """The records of `method` at `world_size`, one per rank."""
    step, step_args, zero_stage = METHODS[method]
    with tempfile.TemporaryDirectory() as scratch:
        command = launch.torchrun(world_size, Path(__file__).resolve(), "--worker", scratch, launch.SCRIPTS[step],
                                  *RUN_ARGS, *(arg.format(world_size=world_size) for arg in step_args),
                                  "--output-dir", Path(scratch) / "run")
        process = subprocess.Popen(command, cwd=launch.ROOT, env=launch.environment(), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        try:
            _, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
        except subprocess.TimeoutExpired:
            # SIGTERM, not SIGKILL: torchrun then stops its workers (in sessions of their own) before it exits.
            process.terminate()
            _, stderr = process.communicate()
            sys.exit(f"error: {method} on {world_size} processes still ran after {LAUNCH_TIMEOUT} s:\n{stderr[-3000:]}")
        if process.returncode:
            sys.exit(f"error: {method} on {world_size} processes failed:\n{stderr[-3000:]}")
        ranks = [json.loads((Path(scratch) / f"rank{rank}.json").read_text()) for rank in range(world_size)]
    return [{"method": method, "step": step, "zero_stage": zero_stage, "world_size": world_size, **record,
             "formula_bytes": formula_bytes(method, world_size)} for record in ranks]


def machine():
    """Where the table was measured, in one line."""
    if torch.cuda.is_available():
        device = torch.cuda.get_device_name()
    else:
        names = re.findall(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M)
        device = f"{names[0] if names else 'CPU'} ({os.cpu_count()} cores)"
    return (f"{device}, torch {torch.__version__}, DeepSpeed {importlib.metadata.version('deepspeed')}, "
            f"synthetic data, fp32, global batch 24, SGD with momentum (09-11: AdamW)")


def megabytes(value):
    return "-" if value is None else f"{value / MB:.2f}"


def table(records):
    """The records as text: one row per rank, in MB (10^6 bytes), then what DeepSpeed's buffers are."""
    header = (f"{'method':<16}{'step':>5}{'N':>3}{'rank':>5}{'params':>9}{'grads':>9}{'optim':>9}{'master':>9}"
              f"{'buffers':>10}{'peak':>10}{'formula':>9}{'build':>9}")
    lines = [machine(), "MB per rank (10^6 bytes); optim includes master; formula: the ZeRO paper's; build: the peak "
             "while the model is built, wrapped or sharded", header]
    for record in records:
        lines.append(f"{record['method']:<16}{record['step']:>5}{record['world_size']:>3}{record['rank']:>5}"
                     + "".join(f"{megabytes(record[key]):>{width}}" for key, width in (
                         ("parameter_bytes", 9), ("gradient_bytes", 9), ("optimizer_bytes", 9),
                         ("master_weight_bytes", 9), ("buffer_bytes", 10), ("peak_bytes", 10),
                         ("formula_bytes", 9), ("build_peak_bytes", 9))))
    lines.append(f"{SIZES} (the momentum and the fp32 master weights)")
    lines.append(f"buffers of {SMALL / 1000:.0f} KB or more, on rank 0 (MB):")
    for record in records:
        large = {path: size for path, size in (record["buffers"] or {}).items() if size >= SMALL}
        if record["rank"] == 0 and large:
            parts = ", ".join(f"{path} {megabytes(size)}" for path, size in large.items())
            lines.append(f"  {record['method']} at {record['world_size']}: {parts}")
    return "\n".join(lines)


def draw(records, output):
    """One panel per method: each rank's parameters, gradients and optimizer state (its master weights hatched),
    stacked, at each world size; the formula's bytes as a line across each group; buffers written above."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    methods = list(dict.fromkeys(record["method"] for record in records))
    world_sizes = sorted({record["world_size"] for record in records})
    colours = {"parameter_bytes": "#5b8fd1", "gradient_bytes": "#f2a65a", "optimizer_bytes": "#6aa84f"}
    columns = min(4, len(methods))
    rows = -(-len(methods) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.6 * columns, 3.3 * rows + 1.2), squeeze=False)
    # ResNet-9's panels share one scale, so that they compare at a glance; the transformers' (09-11) others.
    top = {}
    for record in records:
        model = model_of(record["method"])
        stacked = sum(record[key] for key in colours)
        top[model] = max(top.get(model, 0), stacked, record["formula_bytes"])
    for axis, method in zip(axes.flat, methods, strict=False):
        for group, world_size in enumerate(world_sizes):
            ranks = sorted((record for record in records if record["method"] == method
                            and record["world_size"] == world_size), key=lambda record: record["rank"])
            width = 0.8 / len(ranks)
            for index, record in enumerate(ranks):
                x = group - 0.4 + width * (index + 0.5)
                bottom = 0
                for key, colour in colours.items():
                    axis.bar(x, record[key] / MB, width * 0.9, bottom=bottom, color=colour)
                    bottom += record[key] / MB
                if record["master_weight_bytes"]:  # the upper part of the optimizer's bar
                    axis.bar(x, record["master_weight_bytes"] / MB, width * 0.9, bottom=bottom
                             - record["master_weight_bytes"] / MB, fill=False, hatch="////", edgecolor="white", lw=0)
            if not ranks:
                continue
            axis.hlines(ranks[0]["formula_bytes"] / MB, group - 0.45, group + 0.45, color="black", lw=1.5)
            # Above each group: what the bars leave out, the largest on any rank.
            buffers = max(record["buffer_bytes"] or 0 for record in ranks)
            peak = max(record["peak_bytes"] for record in ranks)
            notes = [f"buffers {buffers / MB:,.1f}"] if buffers >= SMALL else []
            axis.text(group, top[model_of(method)] / MB * 1.42, "\n".join([*notes, f"peak {peak / MB:,.1f}"]),
                      ha="center", va="top", fontsize=7, color="#555555")
        step, _, _ = METHODS[method]
        axis.set_ylim(0, top[model_of(method)] / MB * 1.45)
        axis.set_xticks(range(len(world_sizes)), [str(size) for size in world_sizes])
        axis.set_title(f"{method} ({step})", fontsize=10)
        axis.set_xlabel("processes (a bar per rank)", fontsize=8)
        axis.set_ylabel("MB per rank", fontsize=8)
        axis.tick_params(labelsize=8)
    for axis in axes.flat[len(methods):]:
        axis.axis("off")
    figure.legend(handles=[Patch(color=colours["parameter_bytes"], label="parameters"),
                           Patch(color=colours["gradient_bytes"], label="gradients"),
                           Patch(color=colours["optimizer_bytes"], label="optimizer state"),
                           Patch(facecolor=colours["optimizer_bytes"], hatch="////", edgecolor="white",
                                 label="of which fp32 master weights"),
                           plt.Line2D([], [], color="black", lw=1.5, label="ZeRO paper's formula")],
                  loc="lower center", ncol=5, fontsize=8, frameon=False)
    measured = f"{machine()}, {datetime.date.today()}"
    figure.suptitle(f"Bytes that each rank holds at the optimizer step, measured: {measured}\n"
                    "Formula (ZeRO paper): (4 + 4 + K)·Ψ replicated, (4 + 4 + K/N)·Ψ ZeRO-1, (4 + (4 + K)/N)·Ψ "
                    "ZeRO-2, (4 + 4 + K)·Ψ/N ZeRO-3, FSDP2, and an even split for 08-10; above the bars, in MB: "
                    "the buffers and the peak\n"
                    f"{SIZES} (the momentum and DeepSpeed's fp32 master weights)", fontsize=9)
    figure.tight_layout(rect=(0, 0.05, 1, 1))
    figure.savefig(output, dpi=90)


def main():
    args = parse_args()
    records = [record for method in args.methods for world_size in args.world_sizes
               for record in measure(method, world_size)]
    print(table(records))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(records, indent=1) + "\n")
    if args.output:
        draw(records, args.output)
        print(f"wrote {args.output}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        measure_in_this_process(sys.argv[2], sys.argv[3:])
    else:
        main()
