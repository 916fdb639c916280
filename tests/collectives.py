"""Run step 05 or 08 with every collective call recorded.

    torchrun --standalone --nproc_per_node=2 tests/collectives.py 05_cifar10_deepspeed.py --synthetic ...
    torchrun --standalone --nproc_per_node=2 tests/collectives.py 08_cifar10_pipeline.py --synthetic ...

Before the step starts, every collective of torch.distributed is wrapped to note its name. Each rank
writes `collectives-rank{RANK}.json` into the directory that COLLECTIVES_DIR names, rewritten as it goes:
the step's process ends inside `utils.run` (`os._exit`), and no code after it runs.

05: DeepSpeed's communication calls torch.distributed, as the step itself does. The engine's forward,
backward and step are wrapped to note which of them is running. One entry per training micro-batch,
{"boundary": bool, "forward": [names], "backward": [names], "step": [names]}, where `boundary` says
whether that micro-batch ended an optimizer step.

08: the pipeline schedule's work on this rank's stage, in the order it ran. One entry per training step,
{"stage": index, "actions": [...], "collectives": [names], "gradient_norms": [...]}: the actions are
"F3" (the forward of micro-batch 3), "B3" (its backward), "recv F3" and "send F3" (its activations,
from the previous stage and to the next), "recv B3" and "send B3" (their gradients, from the next stage
and to the previous); the collectives are those that the schedule called; the gradient norms are those
of the stage's parameters, in order, when the schedule returns. Evaluation (forward only) is not
recorded.
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
micro_batches = []  # what this rank recorded (08: one entry per step)
phase = None  # the key of micro_batches[-1] that collectives go to while the engine or schedule runs, else None


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
                write_record()
    return wrapper


def write_record():
    output = Path(os.environ["COLLECTIVES_DIR"]) / f"collectives-rank{os.environ.get('RANK', '0')}.json"
    output.write_text(json.dumps(micro_batches))


def record_pipeline_schedule():
    """Wrap 08's schedules and stages (see the docstring)."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle
    from torch.distributed.pipelining.stage import _PipelineStageBase

    def in_step(step):
        @functools.wraps(step)
        def wrapper(schedule, *args, **kwargs):
            global phase
            if not schedule._has_backward:  # evaluation
                return step(schedule, *args, **kwargs)
            micro_batches.append({"stage": schedule._stage.stage_index, "actions": [], "collectives": []})
            phase = "collectives"
            try:
                return step(schedule, *args, **kwargs)
            finally:
                phase = None
                micro_batches[-1]["gradient_norms"] = [parameter.grad.norm().item()
                                                       for parameter in schedule._stage.submod.parameters()]
                write_record()
        return wrapper

    def action(name, method, returns_ops):
        @functools.wraps(method)
        def wrapper(stage, chunk, *args, **kwargs):
            result = method(stage, chunk, *args, **kwargs)
            if phase is not None and (result if returns_ops else True):  # a first stage receives nothing
                micro_batches[-1]["actions"].append(f"{name}{chunk}")
            return result
        return wrapper

    PipelineScheduleSingle.step = in_step(PipelineScheduleSingle.step)
    for method, name, returns_ops in [("forward_one_chunk", "F", False), ("backward_one_chunk", "B", False),
                                      ("get_fwd_recv_ops", "recv F", True), ("get_fwd_send_ops", "send F", True),
                                      ("get_bwd_recv_ops", "recv B", True), ("get_bwd_send_ops", "send B", True)]:
        setattr(_PipelineStageBase, method, action(name, getattr(_PipelineStageBase, method), returns_ops))


def record_deepspeed_engine():
    from deepspeed.runtime.engine import DeepSpeedEngine

    for name in ("forward", "backward", "step"):
        setattr(DeepSpeedEngine, name, in_phase(name, getattr(DeepSpeedEngine, name)))


if __name__ == "__main__":
    # Wrapped in both modules before DeepSpeed starts: some of its code calls them through
    # torch.distributed, some through distributed_c10d, and some keeps a reference made at start-up.
    for name in COLLECTIVES:
        if hasattr(c10d, name):
            wrapped = recording(name, getattr(c10d, name))
            setattr(c10d, name, wrapped)
            if hasattr(dist, name):
                setattr(dist, name, wrapped)
    if Path(sys.argv[1]).name.startswith("08"):
        record_pipeline_schedule()
    else:
        record_deepspeed_engine()
    run_step_here(sys.argv[1:])
