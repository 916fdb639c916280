"""What a run printed and wrote: exit status, the reported error, metrics.json and model.pt."""

import functools
import glob
import json
import math
import re
import signal
from pathlib import Path

import torch
from jobs import SMOKE_STEPS, run_job
from launch import ON_GPU

from common import data, models

# Step 11's model at its defaults (--experts 8 --top-k 2): what its model.pt loads into.
MIXTURE_OF_EXPERTS = functools.partial(models.VisionTransformer, experts=8, top_k=2)
METRIC_KEYS = {"script", "data", "device", "amp", "world_size", "global_batch_size", "steps", "epochs_completed",
               "train_loss", "test_loss", "test_accuracy", "test_samples", "samples_per_second", "wall_seconds",
               "history"}


def check_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def printed_errors(result):
    """The `error:` lines that the job's processes printed themselves."""
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]


def torchrun_root_cause(result):
    """What torchrun's failure table names as the root cause (None without a table)."""
    match = re.search(r"Root Cause \(first observed failure\):.*?\n  traceback : (.*?)\n", result.stderr, re.S)
    return match and match.group(1)


def check_one_error(result, *fragments):
    """A failed job that reported exactly one `error:` line, containing every fragment, and returns it.

    Under torchrun (and `accelerate launch`, which runs it) the workers print nothing: torchrun's
    failure table names the root cause's line. Elsewhere one process prints it."""
    assert result.returncode != 0, f"should have failed\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    printed, root_cause = printed_errors(result), torchrun_root_cause(result)
    reported = [*printed, *([root_cause] if root_cause and root_cause.startswith("error:") else [])]
    assert len(reported) == 1, f"expected one error line, got {reported}\n{result.stderr[-3000:]}"
    for fragment in fragments:
        assert fragment in reported[0], reported[0]
    return reported[0]


def check_signalled_torchrun(result, number):
    """A torchrun that received signal `number` and passed it on: it exits 1 after its `got signal` traceback. Or,
    after that traceback, torch 2.14.1's torchrun aborts in its own interpreter's shutdown ("terminate called
    without an active exception", SIGABRT: a signalled torchrun leaves its rendezvous' keep-alive thread
    running, PyTorch issue #38228): its workers have exited by then, so what they saved is the same (seen
    once in CI, in the DeepSpeed template's preemption; the caller checks what they saved)."""
    stderr, signalled = result.stderr, f"got signal: {int(number)}"
    assert signalled in stderr, stderr[-5000:]
    # torchrun's abort comes after its traceback: a worker's own line before it does not count.
    aborted = "terminate called without an active exception" in stderr[stderr.rindex(signalled):]
    assert result.returncode in ((1, -signal.SIGABRT) if aborted else (1,)), stderr[-5000:]
    return result


def check_no_shared_memory_left(port):
    """Under its launcher, DeepSpeed's CPU communication op maps a buffer per rank in /dev/shm, named after the
    job's port (05 and the DeepSpeed template remove them): nothing of that job may be left there."""
    left = glob.glob(f"/dev/shm/*_{port}_*")
    assert not left, left


def read_metrics(output_dir):
    return json.loads((Path(output_dir) / "metrics.json").read_text())


def load_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def resumed_steps(output):
    """The steps named by a run's `resumed from FILE: epoch E, step S` lines (rank 0's), in order (not anchored to
    a line: in a job's output file, another stream's bytes may share it)."""
    return [int(step) for step in re.findall(r"resumed from \S+: epoch \d+, step (\d+)\b", output)]


def saved_step(output_dir):
    """The step recorded in `checkpoint.pt`: 04's checkpoint itself, 06's pointer to its saved state."""
    return load_state(Path(output_dir) / "checkpoint.pt")["step"]


def assert_same_weights(path_a, path_b):
    a, b = load_state(path_a), load_state(path_b)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, first: {different[:3]}"


def check_outputs(output_dir, script, world_size, amp="none", model_class=models.ResNet9, steps=SMOKE_STEPS,
                  batch_size=24, **model_options):
    """A run of `steps` steps of `batch_size` that wrote the contract's outputs (DESIGN.md): its metrics, every
    test sample counted exactly once, a plain fp32 model.pt. `model_options`: how the run built its model (for
    example width=16), as `models.load_weights` takes them. Returns the metrics."""
    metrics = read_metrics(output_dir)
    assert METRIC_KEYS <= metrics.keys()
    assert metrics["script"] == script
    device = "cuda" if ON_GPU and script != "01_cifar10_cpu.py" else "cpu"
    assert (metrics["data"], metrics["device"], metrics["amp"]) == ("synthetic", device, amp)
    assert metrics["world_size"] == world_size
    assert (metrics["global_batch_size"], metrics["steps"], metrics["epochs_completed"]) == (batch_size, steps, 0)
    # Every test sample counted exactly once, whatever the world size (1,001 divides by none of 2-6).
    assert metrics["test_samples"] == data.SYNTHETIC_TEST_SIZE
    assert metrics["samples_per_second"] > 0
    # One epoch begun (--max-steps ends it early): one entry, the run's final figures.
    last_epoch = metrics["history"][-1]
    assert len(metrics["history"]) == 1 and last_epoch["step"] == steps
    assert (last_epoch["test_accuracy"], last_epoch["train_loss"]) == (metrics["test_accuracy"], metrics["train_loss"])
    # A plain fp32 state_dict (no "module." prefix, no half-precision copy) that loads on the CPU.
    state = load_state(Path(output_dir) / "model.pt")
    assert all(tensor.dtype == torch.float32 for tensor in state.values() if tensor.is_floating_point())
    models.load_weights(Path(output_dir) / "model.pt", model_class, **model_options)  # strict: every tensor
    return metrics


def check_smoke_run(output_dir, script, world_size, amp="none", model_class=models.ResNet9, steps=SMOKE_STEPS,
                    **model_options):
    """A smoke run (SMOKE_ARGS, or `steps` steps) that wrote the contract's outputs and learned."""
    metrics = check_outputs(output_dir, script, world_size, amp, model_class, steps, **model_options)
    # Learned: an untrained net scores chance (0.10) at a loss of about ln(10). After 30 steps the accuracy is
    # 0.33 to 0.43 and the test loss 1.69 to 2.13 (3 processes, whose BatchNorm statistics come from batches
    # of 8), and another CPU's rounding moves them by a few hundredths: the bounds are chance's.
    assert metrics["test_accuracy"] > 0.25
    assert metrics["test_loss"] < math.log(10)
    assert metrics["train_loss"] < math.log(10)
    return metrics


def trained_once(tmp_path_factory, command, **run_options):
    """`model_of(key)`: the model.pt of the job `command(key, output_dir)`, run and checked once per key
    (for a module-scoped fixture shared by several tests)."""
    weights = {}

    def model_of(key):
        if key not in weights:
            output_dir = tmp_path_factory.mktemp("trained")
            check_ok(run_job(command(key, output_dir), **run_options))
            weights[key] = output_dir / "model.pt"
        return weights[key]

    return model_of
