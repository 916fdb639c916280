"""--resume is exact: a run stopped and resumed ends with the weights of an uninterrupted run."""

import pytest
from helpers import check_exact_resume, python, torchrun

LAUNCH = {
    "01": lambda *args: python("01_cifar10_cpu.py", *args),
    "04": lambda *args: torchrun(2, "04_cifar10_ddp.py", *args),
}


@pytest.mark.parametrize("step", LAUNCH)
def test_resume_mid_epoch_matches_uninterrupted_run(step, tmp_path):
    check_exact_resume(LAUNCH[step], tmp_path)
