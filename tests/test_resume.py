"""--resume is exact: a run stopped and resumed ends with the weights of an uninterrupted run."""

import parity
import pytest
from data_dirs import tiny_cifar10
from jobs import SMALL_RESNET9, VIT_LR, run_job
from launch import forked, python
from outputs import check_ok, load_state, read_metrics, resumed_steps
from resume import END_STEP, check_exact_resume

pytestmark = pytest.mark.full  # the full tier: the quick tier resumes torch.save's, DeepSpeed's and DCP's formats

LAUNCH = {
    "01": lambda *args: python("01_cifar10_cpu.py", *args, *SMALL_RESNET9),
    "02": lambda *args: python("02_cifar10_gpu.py", *args, *SMALL_RESNET9),
    "03": lambda *args: python("03_cifar10_dataparallel.py", *args, *SMALL_RESNET9),
    "04": lambda *args: forked(2, "04_cifar10_ddp.py", *args, *SMALL_RESNET9),
}


@pytest.mark.parametrize("step", LAUNCH)
def test_resume_mid_epoch_matches_uninterrupted_run(step, tmp_path):
    # Started again once finished: one process here (07's resume in the quick tier checks a process group's).
    check_exact_resume(LAUNCH[step], tmp_path, again=step == "01")


FP16 = ["--amp", "fp16", "--width", "8"]  # fp16 is emulated on most CPUs: a small net keeps it quick
FP16_LAUNCH = {
    "02": (lambda *args: python("02_cifar10_gpu.py", *args, *FP16), "checkpoint.pt"),
    "04": (lambda *args: forked(2, "04_cifar10_ddp.py", *args, *FP16), "checkpoint.pt"),
    "07": (lambda *args: forked(2, "07_cifar10_fsdp.py", *args, *FP16), f"checkpoints/step{END_STEP}/train_state.pt"),
}


@pytest.mark.parametrize("step", FP16_LAUNCH)
def test_fp16_resumes_with_its_loss_scale(step, tmp_path):
    """The GradScaler's state (its scale, and the steps since it last changed) is part of the checkpoint: the
    resumed run ends with the uninterrupted run's weights and scaler state. torch scales fp16 on the CPU too."""
    launch, checkpoint = FP16_LAUNCH[step]
    stopped, _ = check_exact_resume(launch, tmp_path)
    scalers = [load_state(directory / checkpoint)["scaler"] for directory in (tmp_path / "straight", stopped)]
    assert scalers[0] == scalers[1] and scalers[0]["_growth_tracker"] > 0, scalers


@pytest.mark.parametrize("script, saved_at, resumed_at, options", [
    ("04_cifar10_ddp.py", 2, 3, ["--norm", "group"]),
    ("07_cifar10_fsdp.py", 2, 3, ["--norm", "group"]),
    # tp 2 x dp 2, resumed by tp 2 alone (docs/tensor-parallel.md); parity.md's options for the transformer.
    ("09_cifar10_tensor_parallel.py", 4, 2, ["--no-dropout", "--width", 32, *VIT_LR]),
    # cp 2 x dp 2, resumed by cp 2 alone.
    ("10_cifar10_context_parallel.py", 4, 2, ["--no-dropout", "--width", 32, *VIT_LR]),
    # ep 2 with 2 copies of the experts, resumed by one process (ep 1: every expert on one rank).
    ("11_cifar10_expert_parallel.py", 4, 1, ["--no-dropout", "--width", 32, *VIT_LR]),
])
def test_resume_with_another_world_size_continues_the_same_run(script, saved_at, resumed_at, options, tmp_path):
    """04's checkpoint holds the whole training state, the sharded ones of 07, 09-11 are resplit across the ranks
    as they load, and the order of the global batches does not depend on the world size: a run stopped
    mid-epoch and resumed at another world size ends where the first world size ends without a stop. Another
    world size sums the gradients in another order, so the comparison is the parity check's: float64 and
    no normalisation over the batch (docs/parity.md). A small data set (8 steps per epoch) keeps it quick
    and lets the resumed run cross an epoch boundary."""
    data_dir = tiny_cifar10(tmp_path / "data", train_size=96, test_size=6)
    args = ["benchmarks/float64.py", script, "--data-dir", data_dir, "--num-workers", 0,
            "--batch-size", 12, "--lr", 0.1, "--epochs", 2, *options]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run_job(forked(saved_at, *args, "--output-dir", straight)))
    check_ok(run_job(forked(saved_at, *args, "--max-steps", 5, "--save-every", 5, "--output-dir", stopped)))
    resumed = check_ok(run_job(forked(resumed_at, *args, "--resume", "--output-dir", stopped)))
    assert resumed_steps(resumed.stdout) == [5], resumed.stdout[-2000:]
    assert read_metrics(stopped)["steps"] == 16
    difference = parity.max_relative_difference(stopped / "model.pt", straight / "model.pt")
    assert difference <= parity.TOLERANCE["float64"], difference
