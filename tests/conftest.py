"""The tests import the benchmarks' modules (launch.py: how to start a step; parity.py: the parity rows),
and share one reference run."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from jobs import SMOKE_ARGS, run_job  # noqa: E402
from launch import torchrun  # noqa: E402
from outputs import check_ok  # noqa: E402


@pytest.fixture(scope="session")
def ddp_weights(tmp_path_factory):
    """model.pt of step 04 (DDP, 2 processes) after a smoke run: the steps that 05 and 07 must take too."""
    output_dir = tmp_path_factory.mktemp("ddp")
    check_ok(run_job(torchrun(2, "04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", output_dir)))
    return output_dir / "model.pt"
