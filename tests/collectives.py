"""Run step 05 with every collective call recorded, micro-batch by micro-batch.

    torchrun --standalone --nproc_per_node=2 tests/collectives.py 05_cifar10_deepspeed.py --synthetic ...

Before the step starts, every collective of torch.distributed (which DeepSpeed's communication calls, as
the step itself does) is wrapped to note its name, and the engine's forward, backward and step are
wrapped to note which of them is running. Each rank writes `collectives-rank{RANK}.json` into the
directory that COLLECTIVES_DIR names: one entry per training micro-batch,
{"boundary": bool, "forward": [names], "backward": [names], "step": [names]}, where `boundary` says
whether that micro-batch ended an optimizer step. The file is rewritten after each micro-batch: the
step's process ends inside `utils.run` (`sys.exit`), and no code after it runs.
"""

import functools
import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from launch import run_step_here  # noqa: E402

COLLECTIVES = ["all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
               "_reduce_scatter_base", "all_gather", "all_gather_into_tensor", "_all_gather_base", "broadcast",
               "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
               "batch_isend_irecv", "barrier", "all_gather_object", "broadcast_object_list"]
micro_batches = []  # what this rank recorded
phase = None  # "forward", "backward" or "step" of micro_batches[-1] while the engine runs it, else None


def recording(name, collective):
    @functools.wraps(collective)
    def wrapper(*args, **kwargs):
        if phase is not None:
            micro_batches[-1][phase].append(name)
        return collective(*args, **kwargs)
    return wrapper


def in_phase(name, method):
    @functools.wraps(method)
    def wrapper(engine, *args, **kwargs):
        global phase
        if not engine.module.training:  # evaluation
            return method(engine, *args, **kwargs)
        if name == "forward":
            micro_batches.append({"boundary": engine.is_gradient_accumulation_boundary(),
                                  "forward": [], "backward": [], "step": []})
        phase = name
        try:
            return method(engine, *args, **kwargs)
        finally:
            phase = None
            if name == "step":
                output = Path(os.environ["COLLECTIVES_DIR"]) / f"collectives-rank{os.environ.get('RANK', '0')}.json"
                output.write_text(json.dumps(micro_batches))
    return wrapper


if __name__ == "__main__":
    # Wrapped in both modules before DeepSpeed starts: some of its code calls them through
    # torch.distributed, some through distributed_c10d, and some keeps a reference made at start-up.
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            wrapped = recording(name, getattr(c10d, name))
            setattr(c10d, name, wrapped)
            if hasattr(dist, name):
                setattr(dist, name, wrapped)
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ("forward", "backward", "step"):
        setattr(DeepSpeedEngine, name, in_phase(name, getattr(DeepSpeedEngine, name)))
    run_step_here(sys.argv[1:])
