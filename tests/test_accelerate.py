"""Step 06 (Accelerate), launched as users launch it: accelerate launch, torchrun, plain python."""

import signal

import pytest
from data_dirs import mnist_data_dir, tiny_mnist
from jobs import MNIST_LR, SHORT_RUN_ARGS, SMOKE_ARGS, SYNTHETIC_ARGS, run_job
from launch import ON_GPU, accelerate_launch, forked, python, torchrun
from outputs import assert_same_weights, check_ok, check_one_error, check_smoke_run, read_metrics, resumed_steps
from resume import END_STEP, TEST_SIZE, TRAIN_SIZE, check_exact_resume

from common import models

SCRIPT = "06_mnist_accelerate.py"


@pytest.mark.full
@pytest.mark.parametrize("launcher, nproc", [("accelerate", 2), ("torchrun", 3)])
def test_accelerate_step(launcher, nproc, tmp_path):
    launch = accelerate_launch if launcher == "accelerate" else torchrun
    result = check_ok(run_job(launch(nproc, SCRIPT, *SMOKE_ARGS, *MNIST_LR, "--output-dir", tmp_path)))
    # A real group of nproc processes (not nproc runs alone), which together count each test sample once.
    # accelerate_config.yaml's fp16 applies where there are GPUs for it (without, the launch overrides it).
    amp = "fp16" if launcher == "accelerate" and ON_GPU else "none"
    check_smoke_run(tmp_path, SCRIPT, world_size=nproc, amp=amp, model_class=models.MnistCNN)
    assert result.stdout.count("epoch 1/1") == 1  # the main process alone prints


@pytest.mark.full
def test_plain_python_is_a_world_of_one(tmp_path):
    check_ok(run_job(python(SCRIPT, *SMOKE_ARGS, *MNIST_LR, "--amp", "bf16", "--output-dir", tmp_path), timeout=120))
    check_smoke_run(tmp_path, SCRIPT, world_size=1, amp="bf16", model_class=models.MnistCNN)


@pytest.mark.full  # the quick tier resumes torch.save, DeepSpeed's and DCP's formats
def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """Dropout draws from each process's own random state: load_state must restore it on every process. Started
    again, the finished run stands."""
    stopped, args = check_exact_resume(lambda *args: forked(2, SCRIPT, *args, *MNIST_LR), tmp_path, tiny_mnist,
                                       again=True)
    # Only the newest complete checkpoint is kept (of steps 4, 6, 8, 12 and 14).
    assert [path.name for path in (stopped / "checkpoints").iterdir()] == [f"step{END_STEP}"]
    # The random states are per process: a checkpoint of 2 processes does not resume in 1.
    result = run_job(python(SCRIPT, *args, *MNIST_LR, "--max-steps", END_STEP + 4, "--resume", "--output-dir", stopped),
                     timeout=60)
    check_one_error(result, "world_size=2, this run has 1", "number of processes")


# The step, run by plain python, killed by SIGKILL inside save_state at step 8, once the weights, optimizer,
# schedule and random state are on the disk and before checkpoint.pt names them: a crash in the middle of a save.
CRASH_IN_A_SAVE = """
import os, runpy, signal, sys
import accelerate.accelerator

def save_or_die(output_dir, *args, **kwargs):
    location = save_accelerator_state(output_dir, *args, **kwargs)
    if output_dir.endswith("step8"):
        os.kill(os.getpid(), signal.SIGKILL)
    return location

save_accelerator_state, accelerate.accelerator.save_accelerator_state = (
    accelerate.accelerator.save_accelerator_state, save_or_die)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.full
def test_a_crash_in_the_middle_of_a_save_resumes_from_the_save_before(tmp_path):
    """save_state writes its files in place: resume must not trust the half-finished save, and the one before
    it must still be there."""
    data_dir = tiny_mnist(tmp_path / "data", TRAIN_SIZE, TEST_SIZE)
    args = ["--data-dir", data_dir, *SHORT_RUN_ARGS, *MNIST_LR, "--epochs", 2, "--save-every", 4, "--max-steps", 12]
    straight, crashed = tmp_path / "straight", tmp_path / "crashed"
    check_ok(run_job(python(SCRIPT, *args, "--output-dir", straight), timeout=120))
    result = run_job(python("-c", CRASH_IN_A_SAVE, SCRIPT, *args, "--output-dir", crashed), timeout=120)
    assert result.returncode == -signal.SIGKILL, result.stderr[-3000:]
    assert (crashed / "checkpoints" / "step8" / "model.safetensors").is_file()
    resumed = check_ok(run_job(python(SCRIPT, *args, "--resume", "--output-dir", crashed), timeout=120))
    assert resumed_steps(resumed.stdout) == [4], resumed.stdout[-2000:]
    assert_same_weights(straight / "model.pt", crashed / "model.pt")


@pytest.mark.full
def test_global_batch_not_divisible_by_world_size(tmp_path):
    result = run_job(torchrun(3, SCRIPT, *SYNTHETIC_ARGS, "--batch-size", 32, "--output-dir", tmp_path), timeout=90)
    check_one_error(result, "--batch-size 32 is not divisible by the world size 3")


@pytest.mark.full
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
