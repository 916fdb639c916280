"""Each step, run as a user runs it, learns and writes the contract's outputs."""

import math

import pytest
from helpers import FAST, ON_GPU, check_ok, python, read_metrics, run, torchrun

from common import data, models

STEPS = 30
METRIC_KEYS = {"script", "data", "device", "amp", "world_size", "global_batch_size", "steps", "epochs_completed",
               "train_loss", "test_loss", "test_accuracy", "test_samples", "samples_per_second", "wall_seconds"}


def check_run(output_dir, script, world_size, amp="none"):
    metrics = read_metrics(output_dir)
    assert METRIC_KEYS <= metrics.keys()
    assert metrics["script"] == script
    device = "cuda" if ON_GPU and script != "01_cifar10_cpu.py" else "cpu"
    assert (metrics["data"], metrics["device"], metrics["amp"]) == ("synthetic", device, amp)
    assert metrics["world_size"] == world_size
    assert (metrics["global_batch_size"], metrics["steps"], metrics["epochs_completed"]) == (24, STEPS, 0)
    # Every test sample counted exactly once, whatever the world size (1,001 divides by none of 2-6).
    assert metrics["test_samples"] == data.SYNTHETIC_TEST_SIZE
    # Learned: an untrained net scores chance (0.10) at a loss of about ln(10).
    assert metrics["test_accuracy"] > 0.25
    assert metrics["test_loss"] < 0.9 * math.log(10)
    assert metrics["train_loss"] < math.log(10)
    assert metrics["samples_per_second"] > 0
    model = models.load_weights(output_dir / "model.pt")  # a plain state_dict, no "module." prefix
    assert models.count_parameters(model) > 1_000_000


@pytest.mark.parametrize("script, extra", [
    ("01_cifar10_cpu.py", ["--num-workers", "2"]),  # the default loader, with worker processes
    ("02_cifar10_gpu.py", ["--amp", "bf16"]),
    ("03_cifar10_dataparallel.py", []),
])
def test_single_process_step(script, extra, tmp_path):
    result = check_ok(run(python(script, *FAST, "--max-steps", STEPS, "--output-dir", tmp_path, *extra), timeout=120))
    check_run(tmp_path, script, world_size=1, amp="bf16" if "bf16" in extra else "none")
    if script != "01_cifar10_cpu.py":
        assert ("no GPU found" in result.stdout) != ON_GPU


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_step(nproc, tmp_path):
    result = check_ok(run(torchrun(nproc, "04_cifar10_ddp.py", *FAST, "--max-steps", STEPS, "--output-dir", tmp_path)))
    check_run(tmp_path, "04_cifar10_ddp.py", world_size=nproc)
    # Rank 0 alone prints: one summary line, not one per process.
    assert result.stdout.count("epoch 1/1") == 1
