"""Step 04 under Slurm, for real: both job scripts of slurm/ submitted with sbatch to a one-node cluster
on 127.0.0.1 (tests/slurm_cluster.py), as two processes on the CPU. Each job must end as the torchrun
run of 04 at the same world size ends: with the same weights, also when its time limit's signal stops it
midway and it goes back to the queue."""

import os
import re
import shlex
import shutil

import pytest
import torch
from jobs import SMOKE_ARGS, SMOKE_STEPS
from launch import ON_GPU, ROOT, free_port
from outputs import assert_same_weights, check_smoke_run, load_state
from slurm_cluster import one_node_cluster, wait_until

# The sbatch options that turn each script's multi-node GPU job into 2 processes on the one CPU node.
JOBS = {
    "slurm/torchrun.sbatch": ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=2"],
    "slurm/srun.sbatch": ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
}
JOB_TIMEOUT = 180
# The preempted job saves every SIGNAL_AFTER_STEP steps and is signalled once the first of them is on disk.
SIGNAL_AFTER_STEP = 5


@pytest.fixture(scope="module")
def slurm():
    """The running cluster; every test that uses it is skipped, with the reason, where it cannot run."""
    if shutil.which("slurmctld") is None:
        pytest.skip("Slurm is not installed (slurm-wlm, munge)")
    if os.geteuid() != 0:
        pytest.skip("slurmd runs the jobs as their users: it needs root")
    if ON_GPU and torch.cuda.device_count() < 2:
        pytest.skip("2 processes need 2 GPUs (NCCL)")
    with one_node_cluster() as cluster:
        yield cluster


@pytest.mark.parametrize("script", JOBS)
def test_slurm_job_trains_as_torchrun_does(script, slurm, ddp_weights, tmp_path):
    job_id = slurm.submit(script, *SMOKE_ARGS, "--output-dir", tmp_path,
                          options=[*JOBS[script], f"--output={tmp_path}/slurm-%j.out"],
                          env={"MASTER_PORT": str(free_port())})
    state = slurm.wait(job_id, JOB_TIMEOUT)
    assert state == "COMPLETED", f"job {job_id} {state}:\n{(tmp_path / f'slurm-{job_id}.out').read_text()[-5000:]}"
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=2)
    assert_same_weights(ddp_weights, tmp_path / "model.pt")


def saved_step(output_dir):
    try:
        return load_state(output_dir / "checkpoint.pt")["step"]
    except (OSError, ValueError):  # not written yet
        return 0


@pytest.mark.parametrize("script", JOBS)
def test_slurm_job_signalled_before_its_time_limit_saves_requeues_and_ends_as_the_uninterrupted_run(
        script, slurm, ddp_weights, tmp_path):
    """The job scripts' #SBATCH --signal=B:USR1@120 and --requeue, for real: SIGUSR1 to the batch shell alone
    (what Slurm sends 2 minutes before the time limit) in the middle of the run. The job saves at one step,
    goes back to the queue, starts again with --resume, and ends with the uninterrupted run's weights."""
    job_id = slurm.submit(script, *SMOKE_ARGS, "--save-every", SIGNAL_AFTER_STEP, "--output-dir", tmp_path,
                          options=[*JOBS[script], f"--output={tmp_path}/slurm-%j.out"],
                          env={"MASTER_PORT": str(free_port())})
    wait_until(lambda: saved_step(tmp_path) >= SIGNAL_AFTER_STEP, JOB_TIMEOUT, "no checkpoint")
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    state = slurm.wait(job_id, JOB_TIMEOUT)
    output = (tmp_path / f"slurm-{job_id}.out").read_text()  # both starts: --open-mode=append
    assert state == "COMPLETED", f"job {job_id} {state}:\n{output[-5000:]}"
    [stopped] = re.findall(r"preempted: SIGUSR1 received; every rank stopped after step (\d+) ", output)
    assert SIGNAL_AFTER_STEP <= int(stopped) < SMOKE_STEPS, output[-5000:]
    assert "requeued: the next start resumes from the checkpoint" in output
    assert f"resumed from step {stopped}" in output
    assert "Restarts=1 " in slurm.run("scontrol", "--oneliner", "show", "job", job_id)
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=2)
    assert_same_weights(ddp_weights, tmp_path / "model.pt")


def test_docs_show_the_commands_that_the_test_runs():
    page = (ROOT / "docs" / "slurm.md").read_text()
    for script, options in JOBS.items():
        assert shlex.join(["sbatch", *options, script, *SMOKE_ARGS]) in page
