"""Step 04 under Slurm, for real: both job scripts of slurm/ submitted with sbatch to a one-node cluster
on 127.0.0.1 (tests/slurm_cluster.py), as two processes on the CPU. Each job must end as the torchrun
run of 04 at the same world size ends: with the same weights."""

import os
import shlex
import shutil

import pytest
import torch
from jobs import SMOKE_ARGS
from launch import ON_GPU, ROOT, free_port
from outputs import assert_same_weights, check_smoke_run
from slurm_cluster import one_node_cluster

# The sbatch options that turn each script's multi-node GPU job into 2 processes on the one CPU node.
JOBS = {
    "slurm/torchrun.sbatch": ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=2"],
    "slurm/srun.sbatch": ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
}
JOB_TIMEOUT = 180


@pytest.fixture(scope="module")
def slurm():
    with one_node_cluster() as cluster:
        yield cluster


@pytest.mark.skipif(shutil.which("slurmctld") is None, reason="Slurm is not installed (slurm-wlm, munge)")
@pytest.mark.skipif(os.geteuid() != 0, reason="slurmd runs the jobs as their users: it needs root")
@pytest.mark.skipif(ON_GPU and torch.cuda.device_count() < 2, reason="2 processes need 2 GPUs (NCCL)")
@pytest.mark.parametrize("script", JOBS)
def test_slurm_job_trains_as_torchrun_does(script, slurm, ddp_weights, tmp_path):
    job_id = slurm.submit(script, *SMOKE_ARGS, "--output-dir", tmp_path,
                          options=[*JOBS[script], f"--output={tmp_path}/slurm-%j.out"],
                          env={"MASTER_PORT": str(free_port())})
    state = slurm.wait(job_id, JOB_TIMEOUT)
    assert state == "COMPLETED", f"job {job_id} {state}:\n{(tmp_path / f'slurm-{job_id}.out').read_text()[-5000:]}"
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=2)
    assert_same_weights(ddp_weights, tmp_path / "model.pt")


def test_docs_show_the_commands_that_the_test_runs():
    page = (ROOT / "docs" / "slurm.md").read_text()
    for script, options in JOBS.items():
        assert shlex.join(["sbatch", *options, script, *SMOKE_ARGS]) in page
