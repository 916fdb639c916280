"""The tests import the benchmarks' modules (launch.py: how to start a step; parity.py: the parity rows),
share one reference run, and never download."""

import socket
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from jobs import SMOKE_ARGS, run_job  # noqa: E402
from launch import torchrun  # noqa: E402
from outputs import check_ok  # noqa: E402

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")


@pytest.fixture(scope="session", autouse=True)
def downloads_fail_at_once():
    """No test downloads, on a machine with a network as on one without: every process the tests start
    (they inherit this environment) sends its requests through a proxy on the loopback that refuses
    them, a port bound and never listened on. A test that needs a data set makes it in a temporary
    directory, or copies it from ../shared/data (tests/data_dirs.py)."""
    with socket.socket() as refusing, pytest.MonkeyPatch.context() as patch:
        refusing.bind(("127.0.0.1", 0))
        for name in PROXY_VARIABLES:
            patch.setenv(name, f"http://127.0.0.1:{refusing.getsockname()[1]}")
        for name in ("no_proxy", "NO_PROXY"):  # no host is exempt
            patch.delenv(name, raising=False)
        patch.setenv("HF_HUB_OFFLINE", "1")  # Accelerate's hub client, should anything ask it
        yield


@pytest.fixture(scope="session")
def ddp_run(tmp_path_factory):
    """Step 04's smoke run with 2 processes (DDP): (its output directory, its completed process)."""
    output_dir = tmp_path_factory.mktemp("ddp")
    return output_dir, check_ok(run_job(torchrun(2, "04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", output_dir)))


@pytest.fixture(scope="session")
def ddp_weights(ddp_run):
    """model.pt of step 04's smoke run with 2 processes: the steps that 05 and 07 must take too."""
    return ddp_run[0] / "model.pt"
