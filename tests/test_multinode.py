"""Several machines ("nodes") on one, with docs/multi-node.md's commands: two torchrun nodes on 127.0.0.1
(a static master and the c10d rendezvous), the same across two network namespaces (two hosts with
addresses of their own), two DeepSpeed nodes without ssh, and a node that dies mid-job. Each job ends
with the weights of the same job on one node. Also the launchers that pass the local rank as an
argument (the legacy torch.distributed.launch, the deepspeed launcher), which common/flags.py accepts.
"""

import os
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from jobs import MNIST_LR, SMOKE_ARGS, SYNTHETIC_ARGS, kill_node, run_job, run_nodes, workers
from launch import deepspeed_nodes, legacy_launch, torchrun, torchrun_nodes
from outputs import assert_same_weights, check_ok, check_smoke_run, read_metrics, trained_once

from common import data

pytestmark = pytest.mark.full  # the full tier (docs/testing.md)

NODES, PROCESSES_PER_NODE = 2, 2
WORLD_SIZE = NODES * PROCESSES_PER_NODE
DDP, ACCELERATE, DEEPSPEED = "04_cifar10_ddp.py", "06_mnist_accelerate.py", "05_cifar10_deepspeed.py"
# A few steps: a node that took the wrong share of the data or of the gradients shows in the weights
# from the first step on.
FEW_STEPS = [*SYNTHETIC_ARGS, "--max-steps", 5]
STEP_ARGS = {DDP: FEW_STEPS, ACCELERATE: [*FEW_STEPS, *MNIST_LR]}
RDZV_ID = "tour"


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """one_node(script): model.pt of the multi-node tests' job on one node (WORLD_SIZE processes)."""
    return trained_once(tmp_path_factory, lambda script, output_dir: torchrun(
        WORLD_SIZE, script, *STEP_ARGS[script], "--output-dir", output_dir))


def check_one_job(results, output_dir, reference):
    """The nodes ran one job of WORLD_SIZE processes: rank 0 alone printed and wrote the outputs (into the
    directory that every node was given, wherever rank 0 ran), every test sample counted once over all
    nodes, and the weights of the same job on one node."""
    for result in results:
        check_ok(result)
    assert sum(result.stdout.count("epoch 1/1") for result in results) == 1
    metrics = read_metrics(output_dir)
    assert metrics["world_size"] == WORLD_SIZE
    assert metrics["test_samples"] == data.SYNTHETIC_TEST_SIZE
    assert_same_weights(output_dir / "model.pt", reference)


@pytest.mark.parametrize("script, rdzv_id", [(DDP, None), (DDP, RDZV_ID), (ACCELERATE, None)],
                         ids=["04-static", "04-c10d", "06-static"])
def test_two_torchrun_nodes(script, rdzv_id, one_node, tmp_path):
    commands = torchrun_nodes(NODES, PROCESSES_PER_NODE, script, *STEP_ARGS[script], "--output-dir", tmp_path,
                              rdzv_id=rdzv_id)
    check_one_job(run_nodes(commands), tmp_path, one_node(script))


@dataclass(frozen=True)
class Host:
    namespace: str
    interface: str
    address: str

    def command(self, command):
        return ["ip", "netns", "exec", self.namespace, *command]


def ip(*args):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=True)


@pytest.fixture(scope="module")
def two_hosts():
    """Two "machines" on this one: two network namespaces, each with its loopback and one end of a veth
    pair (a virtual cable between them) with an address of its own. Needs iproute2 and root."""
    hosts = [Host(f"tour{os.getpid()}-{node}", f"tour{os.getpid()}v{node}", f"10.199.0.{node + 1}") for node in (0, 1)]
    try:
        ip("netns", "add", hosts[0].namespace)
    except FileNotFoundError:
        pytest.skip("iproute2's `ip` is not installed")
    except subprocess.CalledProcessError as error:
        pytest.skip(f"cannot create a network namespace (needs root, CAP_NET_ADMIN): {error.stderr.strip()}")
    try:
        ip("netns", "add", hosts[1].namespace)
        ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            ip("link", "set", host.interface, "netns", host.namespace)
            ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            ip("-n", host.namespace, "link", "set", host.interface, "up")
            ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        # A namespace takes the veth end inside it, and with it the other end, when it goes; a pair that
        # never left this namespace goes with its first end.
        subprocess.run(["ip", "link", "delete", hosts[0].interface], capture_output=True)
        for host in hosts:
            subprocess.run(["ip", "netns", "delete", host.namespace], capture_output=True)


def test_two_nodes_in_network_namespaces(two_hosts, one_node, tmp_path):
    """Across a network link between two addresses, with the c10d rendezvous (which has the pitfalls of
    the static one and its own; the static command line runs on 127.0.0.1 above). gloo is told the
    interface to use: it would otherwise advertise the address that the host name resolves to,
    127.0.0.1, which the other node cannot reach."""
    commands = torchrun_nodes(NODES, PROCESSES_PER_NODE, DDP, *STEP_ARGS[DDP], "--output-dir", tmp_path,
                              master_addr=two_hosts[0].address, rdzv_id=RDZV_ID,
                              node_addrs=[host.address for host in two_hosts])
    results = run_nodes([host.command(command) for host, command in zip(two_hosts, commands, strict=True)],
                        envs=[{"GLOO_SOCKET_IFNAME": host.interface} for host in two_hosts])
    check_one_job(results, tmp_path, one_node(DDP))


def test_a_node_that_dies_fails_the_job_at_once(tmp_path):
    """Node 1 (its launcher and its workers) is killed once training has begun. The operating system
    closes the dead processes' connections, so node 0's workers fail in their next collective instead
    of waiting for the process group's timeout (5 minutes), and node 0's torchrun stops the job."""
    killed_at = []

    def kill_node_1_once_training_has_begun(processes):
        if not killed_at and (tmp_path / "checkpoint.pt").exists():
            kill_node(processes[1])
            killed_at.append(time.monotonic())

    # One epoch (100 steps) with a checkpoint every 2: the first marks the start of training.
    commands = torchrun_nodes(NODES, 1, DDP, *SYNTHETIC_ARGS, "--save-every", 2, "--output-dir", tmp_path)
    survivor, killed = run_nodes(commands, poll=kill_node_1_once_training_has_begun, timeout=120)
    assert killed_at, f"the job ended before training began\n{survivor.stderr[-3000:]}"
    assert killed.returncode == -signal.SIGKILL
    assert survivor.returncode != 0 and not (tmp_path / "metrics.json").exists()
    waited = time.monotonic() - killed_at[0]
    assert waited < 60, f"node 0 took {waited:.0f} s to fail"
    assert re.search(r"Connection (reset|closed) by peer", survivor.stderr), survivor.stderr[-3000:]


def test_two_deepspeed_nodes_without_ssh(ddp_weights, tmp_path):
    """A hostfile of two machines, and the launcher started on each by hand: a world of 2 that takes
    exactly DDP's steps (as on one machine, tests/test_deepspeed.py). The first DeepSpeed run on a
    machine compiles a small op (about 45 s on 2 cores, unless install.sh built it): the timeout allows for it."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    output_dir = tmp_path / "run"
    results = run_nodes(deepspeed_nodes(hostfile, DEEPSPEED, *SMOKE_ARGS, "--output-dir", output_dir),
                        envs=[{"OMP_NUM_THREADS": "1"}] * 2, timeout=420)
    for result in results:
        check_ok(result)
        # The launcher passed each node's one process its local rank as an argument: common/flags.py
        # accepts --local_rank.
        assert re.search(rf"spawned with command: \[.*'{DEEPSPEED}', '--local_rank=0'", result.stdout)
    check_smoke_run(output_dir, DEEPSPEED, world_size=2)
    assert_same_weights(output_dir / "model.pt", ddp_weights)


def test_legacy_launcher_passes_local_rank_and_trains_as_torchrun(ddp_weights, tmp_path):
    """`python -m torch.distributed.launch`, deprecated but still in the classic tutorials."""
    arguments = {}

    def record_workers_arguments(process):
        for rank, pid in workers(process).items():
            try:
                arguments[rank] = Path(f"/proc/{pid}/cmdline").read_text().split("\0")
            except OSError:  # it has just exited
                pass

    check_ok(run_job(legacy_launch(2, DDP, *SMOKE_ARGS, "--output-dir", tmp_path), poll=record_workers_arguments))
    # Each process was given its local rank as an argument, which common/flags.py accepts.
    given = {rank: [arg for arg in args if arg.startswith("--local")] for rank, args in arguments.items()}
    assert given == {0: ["--local-rank=0"], 1: ["--local-rank=1"]}
    check_smoke_run(tmp_path, DDP, world_size=2)
    assert_same_weights(tmp_path / "model.pt", ddp_weights)
