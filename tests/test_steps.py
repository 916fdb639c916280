"""Each step, run as a user runs it, learns and writes the contract's outputs."""

import pytest
from data_dirs import tiny_cifar10
from jobs import SHORT_RUN_ARGS, SMOKE_ARGS, run_job, sized_for
from launch import ON_GPU, python, torchrun
from outputs import check_ok, check_smoke_run, read_metrics


@pytest.mark.parametrize("script, extra", [
    ("01_cifar10_cpu.py", ["--num-workers", "2"]),  # the default loader, with worker processes
    ("02_cifar10_gpu.py", ["--amp", "bf16"]),
    ("02_cifar10_gpu.py", ["--amp", "fp16"]),  # torch scales fp16 losses on the CPU too
    ("03_cifar10_dataparallel.py", []),
])
def test_single_process_step(script, extra, tmp_path):
    amp = extra[1] if "--amp" in extra else "none"
    size, timeout, width = sized_for(amp)
    result = check_ok(run_job(python(script, *SMOKE_ARGS, *size, "--output-dir", tmp_path, *extra), timeout=timeout))
    check_smoke_run(tmp_path, script, world_size=1, amp=amp, width=width)
    if script != "01_cifar10_cpu.py":
        assert ("no GPU found" in result.stdout) != ON_GPU


@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_step(nproc, request, tmp_path):
    if nproc == 2:  # the run that other tests compare with (conftest.py)
        tmp_path, result = request.getfixturevalue("ddp_run")
    else:
        result = check_ok(run_job(torchrun(nproc, "04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", tmp_path)))
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=nproc)
    # Rank 0 alone prints: one summary line, not one per process.
    assert result.stdout.count("epoch 1/1") == 1


def test_ddp_with_more_processes_than_test_samples(tmp_path):
    """The rank whose test slice is empty evaluates nothing and still takes part in every collective of the
    evaluation: DDP's own forward would broadcast BatchNorm's statistics in the first test batch, which
    that rank never runs (it hung here)."""
    data_dir = tiny_cifar10(tmp_path / "data", 48, 2)
    check_ok(run_job(torchrun(3, "04_cifar10_ddp.py", "--data-dir", data_dir, *SHORT_RUN_ARGS,
                              "--output-dir", tmp_path), timeout=120))
    assert read_metrics(tmp_path)["test_samples"] == 2


def test_ddp_step_without_a_launcher_is_a_world_of_one(tmp_path):
    check_ok(run_job(python("04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", tmp_path), timeout=120))
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=1)
