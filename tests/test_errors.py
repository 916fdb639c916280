"""Bad input: one clear line from one rank, a non-zero exit, within seconds (never a hang)."""

from helpers import FAST, ON_GPU, check_one_error, python, run, torchrun

from common import models, utils


def test_global_batch_not_divisible_by_world_size(tmp_path):
    result = run(torchrun(3, "04_cifar10_ddp.py", *FAST, "--batch-size", 32, "--output-dir", tmp_path), timeout=90)
    check_one_error(result, "--batch-size 32 is not divisible by the world size 3")


def test_offline_without_data_names_the_directory_and_synthetic(tmp_path):
    data_dir = tmp_path / "no-data"
    result = run(python("01_cifar10_cpu.py", "--data-dir", data_dir, "--output-dir", tmp_path), timeout=120)
    check_one_error(result, str(data_dir), "--synthetic")
    assert "Traceback" not in result.stderr


def test_offline_without_data_under_torchrun(tmp_path):
    """Rank 0's download fails; every rank still leaves the barrier and reports, only rank 0 prints."""
    data_dir = tmp_path / "no-data"
    result = run(torchrun(2, "04_cifar10_ddp.py", "--data-dir", data_dir, "--output-dir", tmp_path), timeout=120)
    check_one_error(result, str(data_dir), "--synthetic")


def test_data_dir_that_is_a_file(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    result = run(python("02_cifar10_gpu.py", "--data-dir", not_a_dir, "--output-dir", tmp_path), timeout=60)
    check_one_error(result, "is a file, not a directory")


def test_corrupt_checkpoint(tmp_path):
    path = tmp_path / "checkpoint.pt"
    utils.save_atomic({"model": models.ResNet9().state_dict()}, path)
    path.write_bytes(path.read_bytes()[:5000])
    result = run(python("03_cifar10_dataparallel.py", *FAST, "--resume", "--output-dir", tmp_path), timeout=60)
    check_one_error(result, "corrupt or truncated")
    assert "Traceback" not in result.stderr


def test_resume_without_checkpoint(tmp_path):
    result = run(python("01_cifar10_cpu.py", *FAST, "--resume", "--output-dir", tmp_path), timeout=60)
    check_one_error(result, "no checkpoint")


def test_bad_flag_values(tmp_path):
    for args, message in ((["--batch-size", "0"], "--batch-size: must be a positive integer"),
                          (["--epochs", "-1"], "--epochs: must be a positive integer"),
                          (["--amp", "fp8"], "invalid choice: 'fp8'"),
                          *([] if ON_GPU else [(["--amp", "fp16"], "--amp fp16 needs a GPU")])):
        result = run(python("02_cifar10_gpu.py", *FAST, *args, "--output-dir", tmp_path), timeout=60)
        check_one_error(result, message)
        assert "Traceback" not in result.stderr and "usage:" not in result.stderr
