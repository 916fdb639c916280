"""The tests import the benchmarks' modules (launch.py: how to start a step; parity.py: the parity rows),
run on pytest-xdist's workers, share a reference run (one per worker that needs it), and never download."""

import os
import socket
import sys
from pathlib import Path

import pytest
import torch
from xdist.scheduler import LoadScopeScheduling

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
# The checks shared by the tests: a failed `assert` there says what it compared, as in a test module.
pytest.register_assert_rewrite("jobs", "outputs", "resume")

from jobs import SMOKE_ARGS, run_job  # noqa: E402
from launch import ON_GPU, torchrun  # noqa: E402
from outputs import check_ok  # noqa: E402

PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY")
# Modules whose tests share what a module-scoped fixture ran or started (runs, a Slurm cluster, network
# namespaces): their tests go to one worker, which runs it once.
SHARED_FIXTURES = {"test_ddp_from_scratch", "test_deepspeed", "test_faults", "test_memory", "test_multinode",
                   "test_parity", "test_pipeline", "test_recipe", "test_slurm", "test_templates"}


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="K/N", help="run only the K-th of N shards of the selected tests, K from 1 "
                     "to N (the tests in turn, in the order of their ids): .ci/run runs one shard of the full tier "
                     "per commit (docs/testing.md)")


def shard_option(config):
    """(K, N) of `--shard K/N`, or None."""
    value = config.getoption("--shard")
    if value is None:
        return None
    shard, _, count = value.partition("/")
    if not (shard.isdigit() and count.isdigit() and 1 <= int(shard) <= int(count)):
        raise pytest.UsageError(f"--shard {value}: K/N, K from 1 to N")
    return int(shard), int(count)


@pytest.hookimpl(trylast=True)  # after -m has deselected the other tiers
def pytest_collection_modifyitems(config, items):
    option = shard_option(config)
    if option is None:
        return
    shard, count = option
    kept = set(shards([(item.nodeid, item.fixturenames) for item in items], count)[shard - 1])
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in kept])
    items[:] = [item for item in items if item.nodeid in kept]


# The module-scoped fixtures whose run (a benchmark, a trace, a cluster, network namespaces) several tests share,
# each test naming it as an argument (what `item.fixturenames` holds).
SHARED_RUNS = {"measured", "one_node", "two_hosts", "traced", "runs", "slurm"}


def shards(tests, count):
    """`count` lists of test ids from `tests`, [(id, fixture names)]: the units in turn, in the order of their
    names, so that each shard gets its share of every parametrized family (each step's faults, each template's
    checks). A unit is the tests of a module that use one of its SHARED_RUNS, which then runs once, or a test."""
    def unit(test_id, fixtures):
        shared = sorted(SHARED_RUNS.intersection(fixtures))
        return f"{test_id.split('::')[0]}::{shared[0]}" if shared else test_id

    position = {name: index for index, name in enumerate(sorted({unit(*test) for test in tests}))}
    return [[test[0] for test in tests if position[unit(*test)] % count == shard] for shard in range(count)]


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml): two workers, each running one test's job at a time. On 2 cores most of a job
    is Python starting on one core (torchrun imports torch before its workers do): a second job fills the
    other. A GPU machine runs one job at a time, since each takes every GPU."""
    return 1 if ON_GPU else 2


def pytest_configure(config):
    """Under two workers, every process of every job computes on one thread, as torchrun's workers do (a
    user's OMP_NUM_THREADS is kept). A single process would otherwise take a thread per core, and two such jobs
    at once oversubscribe the cores (on the 2-core development CPU, AVX2 held, two fp16 smoke runs of 02 side by side
    took 88 s at 2 threads each, 56 s at one)."""
    shard_option(config)  # a bad --shard stops here, before xdist's workers collect
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", 1)) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # the jobs inherit it (launch.environment)
        torch.set_num_threads(1)  # the tests that compute in their own process


class SharedFixtureScheduling(LoadScopeScheduling):
    """pytest-xdist's `--dist loadscope` (units of work to the workers as they free up, the largest first),
    where a unit is one test, or every test of a module of SHARED_FIXTURES. It replaces `--dist`: the
    `--dist loadgroup` that would do this reads node ids that pytest 9 no longer takes from it."""

    def _split_scope(self, nodeid):
        module = nodeid.split("::", 1)[0]
        return module if Path(module).stem in SHARED_FIXTURES else nodeid


def pytest_xdist_make_scheduler(config, log):
    return SharedFixtureScheduling(config, log)


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
