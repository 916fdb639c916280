"""--resume is exact: a run stopped and resumed ends with the weights of an uninterrupted run."""

import pytest
from helpers import FAST, STEPS_PER_EPOCH, assert_same_weights, check_ok, python, read_metrics, run, torchrun

# Two epochs; the first run stops in the middle of epoch 1, the resumed run crosses into epoch 2.
STOP, END = 60, 130
ARGS = [*FAST, "--epochs", "2"]
assert STOP < STEPS_PER_EPOCH < END < 2 * STEPS_PER_EPOCH

LAUNCH = {
    "01": lambda *args: python("01_cifar10_cpu.py", *args),
    "04": lambda *args: torchrun(2, "04_cifar10_ddp.py", *args),
}


@pytest.mark.parametrize("step", LAUNCH)
def test_resume_mid_epoch_matches_uninterrupted_run(step, tmp_path):
    launch = LAUNCH[step]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run(launch(*ARGS, "--max-steps", END, "--output-dir", straight)))
    check_ok(run(launch(*ARGS, "--max-steps", STOP, "--save-every", 25, "--output-dir", stopped)))
    resumed = check_ok(run(launch(*ARGS, "--max-steps", END, "--save-every", 25, "--resume", "--output-dir", stopped)))
    assert f"resumed from step {STOP}" in resumed.stdout
    assert_same_weights(straight / "model.pt", stopped / "model.pt")
    a, b = read_metrics(straight), read_metrics(stopped)
    assert (b["steps"], b["epochs_completed"]) == (END, 1)
    assert (a["test_loss"], a["test_accuracy"]) == (b["test_loss"], b["test_accuracy"])
