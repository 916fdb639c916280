"""init_methods.py: 04's job started four ways, each with 2 processes (env:// under torchrun, tcp:// and file://
with the processes started by hand, mp.spawn), ends with 04's weights; an init file left by a killed job is
refused at once; bad input in spawned processes is reported in one line."""

import re

import pytest
import torch
from jobs import SMOKE_ARGS, SYNTHETIC_ARGS, kill_node, run_job, run_nodes
from launch import ON_GPU, free_port, python, torchrun
from outputs import assert_same_weights, check_ok, check_one_error, check_smoke_run

SCRIPT = "init_methods.py"

pytestmark = [pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2, reason="2 processes need 2 GPUs"),
              pytest.mark.full]  # the full tier: a side road of step 04 (docs/testing.md)


def job(init, run_args, init_file):
    """The command lines of a job of 2 processes started through `init` (with tcp and file, one command per
    process, as a user starts them by hand), and a pattern of the init_method URL they join through."""
    args = ["--init", init, *run_args]
    if init == "env":
        return [torchrun(2, SCRIPT, *args)], re.escape("env://")
    if init == "spawn":  # the script picks a free port itself
        return [python(SCRIPT, *args, "--world-size", 2)], r"tcp://127\.0\.0\.1:\d+"
    if init == "tcp":
        port = free_port()
        where, url = ["--master-addr", "127.0.0.1", "--master-port", port], f"tcp://127.0.0.1:{port}"
    else:
        where, url = ["--init-file", init_file], f"file://{init_file}"
    return [python(SCRIPT, *args, *where, "--world-size", 2, "--rank", rank) for rank in range(2)], re.escape(url)


@pytest.mark.parametrize("init", ["env", "tcp", "file", "spawn"])
def test_each_init_method_trains_04s_job_to_04s_weights(init, ddp_weights, tmp_path):
    init_file = tmp_path / "init_file"
    commands, url = job(init, [*SMOKE_ARGS, "--output-dir", tmp_path / "out"], init_file)
    # Without the tests' one thread per process (conftest.py): init_methods.py sets it where it is unset.
    results = run_nodes(commands, envs=[{"OMP_NUM_THREADS": None}] * len(commands))
    printed = "".join(check_ok(result).stdout for result in results)
    for rank in range(2):
        assert re.search(rf"^rank {rank} of 2 joined through {url}$", printed, re.M), printed
    metrics = check_smoke_run(tmp_path / "out", SCRIPT, world_size=2)  # exact evaluation, learned, model.pt
    assert metrics["init"] == init
    # The same job, started another way: 04's weights (ddp_weights: 04 under torchrun, 2 processes, SMOKE_ARGS).
    assert_same_weights(tmp_path / "out" / "model.pt", ddp_weights)
    assert not init_file.exists()  # a file:// job that ends well leaves no init file to trip the next one


def test_an_init_file_left_by_a_killed_job_is_refused_at_once(tmp_path):
    init_file = tmp_path / "init_file"
    commands, _ = job("file", [*SYNTHETIC_ARGS, "--output-dir", tmp_path / "out"], init_file)

    def kill_once_both_have_claimed_their_rank(processes):
        if init_file.exists() and all(f"/rank_{rank}".encode() in init_file.read_bytes() for rank in range(2)):
            for process in processes:
                kill_node(process)

    killed = run_nodes(commands, poll=kill_once_both_have_claimed_their_rank)
    assert [result.returncode for result in killed] == [-9, -9]  # killed, not finished: a whole epoch to train
    assert init_file.exists()
    # Each process started by hand reports its own line, long before the gloo timeout (5 minutes).
    for result in run_nodes(commands, timeout=60):
        assert result.returncode == 2
        check_one_error(result, f"--init-file {init_file} is left from an earlier job", "delete it")


def test_bad_input_in_spawned_processes_is_one_line():
    """Both spawned processes find the batch larger than the training set; the first reports it."""
    result = run_job(python(SCRIPT, "--init", "spawn", "--world-size", 2, "--synthetic", "--batch-size", 4800))
    assert result.returncode == 2
    check_one_error(result, "--batch-size 4800 is larger than the training set (2400)")
