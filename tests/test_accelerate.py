"""Step 06 (Accelerate), launched as users launch it: accelerate launch, torchrun, plain python."""

import pytest
from data_dirs import mnist_data_dir, tiny_mnist
from jobs import MNIST_LR, SMOKE_ARGS, SYNTHETIC_ARGS, run_job
from launch import ON_GPU, accelerate_launch, python, torchrun
from outputs import check_ok, check_one_error, check_smoke_run, read_metrics
from resume import END_STEP, check_exact_resume

from common import models

SCRIPT = "06_mnist_accelerate.py"


@pytest.mark.parametrize("launcher, nproc", [("accelerate", 2), ("torchrun", 3)])
def test_accelerate_step(launcher, nproc, tmp_path):
    launch = accelerate_launch if launcher == "accelerate" else torchrun
    result = check_ok(run_job(launch(nproc, SCRIPT, *SMOKE_ARGS, *MNIST_LR, "--output-dir", tmp_path)))
    # A real group of nproc processes (not nproc runs alone), which together count each test sample once.
    # accelerate_config.yaml's fp16 applies where there are GPUs for it (without, the launch overrides it).
    amp = "fp16" if launcher == "accelerate" and ON_GPU else "none"
    check_smoke_run(tmp_path, SCRIPT, world_size=nproc, amp=amp, model_class=models.MnistCNN)
    assert result.stdout.count("epoch 1/1") == 1  # the main process alone prints


def test_plain_python_is_a_world_of_one(tmp_path):
    check_ok(run_job(python(SCRIPT, *SMOKE_ARGS, *MNIST_LR, "--amp", "bf16", "--output-dir", tmp_path), timeout=120))
    check_smoke_run(tmp_path, SCRIPT, world_size=1, amp="bf16", model_class=models.MnistCNN)


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """Dropout draws from each process's own random state: load_state must restore it on every process."""
    stopped, args = check_exact_resume(lambda *args: torchrun(2, SCRIPT, *args, *MNIST_LR), tmp_path, tiny_mnist)
    # Only the newest complete checkpoint is kept (of steps 4, 6, 8, 12 and 14).
    assert [path.name for path in (stopped / "checkpoints").iterdir()] == [f"step{END_STEP}"]
    # The random states are per process: a checkpoint of 2 processes does not resume in 1.
    result = run_job(python(SCRIPT, *args, *MNIST_LR, "--max-steps", END_STEP + 4, "--resume", "--output-dir", stopped),
                     timeout=60)
    check_one_error(result, "world_size=2, this run has 1", "number of processes")


def test_global_batch_not_divisible_by_world_size(tmp_path):
    result = run_job(torchrun(3, SCRIPT, *SYNTHETIC_ARGS, "--batch-size", 32, "--output-dir", tmp_path), timeout=90)
    check_one_error(result, "--batch-size 32 is not divisible by the world size 3")


@pytest.mark.skipif(ON_GPU, reason="fp16 is refused on CPU-only machines")
def test_config_fp16_on_a_cpu_machine_is_one_clear_error(tmp_path):
    """accelerate_config.yaml asks for fp16; without a GPU the error says how to override it."""
    result = run_job(accelerate_launch(2, SCRIPT, *SYNTHETIC_ARGS, "--output-dir", tmp_path, config_precision=True),
                     timeout=90)
    check_one_error(result, "--amp fp16 needs a GPU", "--mixed_precision no")


@pytest.mark.slow
def test_real_mnist_one_epoch_two_processes(tmp_path):
    """The real torchvision path, offline, at the step's defaults (04's global batch, SGD and one-cycle
    schedule) over one epoch: 98%, every one of the 10,000 test images counted once."""
    data_dir = mnist_data_dir(tmp_path)
    check_ok(run_job(torchrun(2, SCRIPT, "--data-dir", data_dir, "--epochs", 1, "--num-workers", 0,
                              "--output-dir", tmp_path / "run"), timeout=480))
    metrics = read_metrics(tmp_path / "run")
    assert (metrics["data"], metrics["world_size"], metrics["epochs_completed"]) == ("mnist", 2, 1)
    assert metrics["test_samples"] == 10_000
    assert metrics["test_accuracy"] >= 0.98, metrics
