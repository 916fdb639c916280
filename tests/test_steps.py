"""Each step, run as a user runs it, learns and writes the contract's outputs."""

import pytest
from jobs import SMOKE_ARGS, run_job
from launch import ON_GPU, python, torchrun
from outputs import check_ok, check_smoke_run


@pytest.mark.parametrize("script, extra", [
    ("01_cifar10_cpu.py", ["--num-workers", "2"]),  # the default loader, with worker processes
    ("02_cifar10_gpu.py", ["--amp", "bf16"]),
    ("03_cifar10_dataparallel.py", []),
])
def test_single_process_step(script, extra, tmp_path):
    result = check_ok(run_job(python(script, *SMOKE_ARGS, "--output-dir", tmp_path, *extra), timeout=120))
    check_smoke_run(tmp_path, script, world_size=1, amp="bf16" if "bf16" in extra else "none")
    if script != "01_cifar10_cpu.py":
        assert ("no GPU found" in result.stdout) != ON_GPU


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_step(nproc, tmp_path):
    result = check_ok(run_job(torchrun(nproc, "04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", tmp_path)))
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=nproc)
    # Rank 0 alone prints: one summary line, not one per process.
    assert result.stdout.count("epoch 1/1") == 1


def test_ddp_step_without_a_launcher_is_a_world_of_one(tmp_path):
    check_ok(run_job(python("04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", tmp_path), timeout=120))
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=1)
