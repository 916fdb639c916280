"""The suite needs no network, and a network does not change it: with one that works, no test downloads
(tests/conftest.py refuses every request); with one that stalls, a run without its data still ends with
the one-line error, in seconds of the download's timeout, not the test's."""

import socket
import threading

import pytest
from conftest import PROXY_VARIABLES
from data_dirs import mnist_data_dir, tiny_cifar10
from jobs import SHORT_RUN_ARGS, run_job
from launch import python, torchrun
from outputs import check_ok, check_one_error

pytestmark = pytest.mark.full  # the full tier (docs/testing.md)


@pytest.fixture
def stalling_proxy():
    """A proxy on the loopback that accepts every connection and never answers, as a network that drops
    packets does. Yields the list of the connections it accepted."""
    accepted = []
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.2)
        stop = threading.Event()

        def accept():
            while not stop.is_set():
                try:
                    accepted.append(server.accept()[0])
                except TimeoutError:
                    continue

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        try:
            yield {name: f"http://127.0.0.1:{server.getsockname()[1]}" for name in PROXY_VARIABLES}, accepted
        finally:
            stop.set()
            thread.join(timeout=5)
            for connection in accepted:
                connection.close()


@pytest.mark.parametrize("launch", [
    lambda *args: python("01_cifar10_cpu.py", *args),
    lambda *args: torchrun(2, "04_cifar10_ddp.py", *args),  # the second process does not try again
], ids=["python", "torchrun"])
def test_a_stalling_network_ends_in_the_no_data_error(launch, stalling_proxy, tmp_path):
    environment, accepted = stalling_proxy
    data_dir = tmp_path / "no-data"
    result = run_job(launch("--data-dir", data_dir, "--output-dir", tmp_path / "out"), timeout=120, env=environment)
    check_one_error(result, str(data_dir), "could not be downloaded", "--synthetic")
    assert accepted, "the download never reached the proxy"
    assert not (tmp_path / "out" / "metrics.json").exists()


@pytest.mark.parametrize("data_set", ["cifar10 arrays", "official mnist archives"])
def test_a_run_with_its_data_opens_no_connection(data_set, stalling_proxy, tmp_path):
    """The real loading path (torchvision's md5 check, for MNIST) finds the files and asks no network."""
    environment, accepted = stalling_proxy
    if data_set == "cifar10 arrays":
        command = python("01_cifar10_cpu.py", "--data-dir", tiny_cifar10(tmp_path / "data", 48, 10))
    else:
        command = python("06_mnist_accelerate.py", "--data-dir", mnist_data_dir(tmp_path))
    check_ok(run_job([*command, *SHORT_RUN_ARGS, "--max-steps", "2", "--output-dir", tmp_path / "out"],
                     timeout=120, env=environment))
    assert not accepted
