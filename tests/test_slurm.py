"""Step 04 under Slurm, for real: both job scripts of slurm/ submitted with sbatch to a one-node cluster
on 127.0.0.1 (tests/slurm_cluster.py), as two processes on the CPU. Each job must end as the torchrun
run of 04 at the same world size ends, with the same weights, after its time limit's signal has stopped it
midway and it has gone back to the queue."""

import os
import re
import shlex
import shutil

import pytest
import torch
from jobs import SMOKE_ARGS, SMOKE_STEPS, with_default_workers
from launch import ON_GPU, ROOT, free_port
from outputs import assert_same_weights, check_smoke_run, resumed_steps, saved_step
from slurm_cluster import ENDED, one_node_cluster, wait_until

pytestmark = pytest.mark.full  # the full tier (docs/testing.md)

# The sbatch options that turn each script's multi-node GPU job into 2 processes on the one CPU node.
JOBS = {
    "slurm/torchrun.sbatch": ["--nodes=1", "--gpus-per-node=0", "--cpus-per-task=2", "--export=ALL,NPROC_PER_NODE=2"],
    "slurm/srun.sbatch": ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1"],
}
JOB_TIMEOUT = 180
# 04's smoke run, with a checkpoint every SIGNAL_AFTER_STEP steps: the job is signalled once the first is on disk.
SIGNAL_AFTER_STEP = 5
SLURM_JOB_ARGS = [*with_default_workers(SMOKE_ARGS), "--save-every", str(SIGNAL_AFTER_STEP)]


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


def checkpointed(output_dir):
    """Whether 04 has written the checkpoint of step SIGNAL_AFTER_STEP (or a later one)."""
    try:
        return saved_step(output_dir) >= SIGNAL_AFTER_STEP
    except (OSError, ValueError):  # not written yet
        return False


@pytest.mark.parametrize("script", JOBS)
def test_slurm_job_trains_as_torchrun_does_also_when_its_time_limit_signal_requeues_it(script, slurm, ddp_weights,
                                                                                       tmp_path):
    """The job scripts as written, #SBATCH --signal=B:USR1@120 and --requeue included. In the middle of the run,
    SIGUSR1 to the batch shell alone: what Slurm sends 2 minutes before the time limit. The job saves at one
    step, goes back to the queue, starts again and resumes by itself (04 reads SLURM_RESTART_COUNT), and ends
    COMPLETED with the weights of the torchrun run that nothing stopped."""
    job_id = slurm.submit(script, *SLURM_JOB_ARGS, "--output-dir", tmp_path,
                          options=[*JOBS[script], f"--output={tmp_path}/slurm-%j.out"],
                          env={"MASTER_PORT": str(free_port())})
    wait_until(lambda: checkpointed(tmp_path) or slurm.job_state(job_id) in ENDED, JOB_TIMEOUT,
               "no checkpoint")
    slurm.run("scancel", "--signal=USR1", "--batch", job_id)
    output_file = tmp_path / f"slurm-{job_id}.out"  # both starts: --open-mode=append
    state = slurm.wait(job_id, JOB_TIMEOUT, output_file)
    # Two processes' output meets in one file, a character's bytes sometimes split by the other's line.
    output = output_file.read_text(errors="replace")
    assert state == "COMPLETED", f"job {job_id} {state}:\n{output[-5000:]}"
    [stopped] = re.findall(r"preempted: SIGUSR1 received; every rank stopped after step (\d+) ", output)
    assert SIGNAL_AFTER_STEP <= int(stopped) < SMOKE_STEPS, output[-5000:]
    assert "requeued: the next start resumes from the checkpoint" in output
    assert resumed_steps(output) == [int(stopped)], output[-5000:]
    assert "Restarts=1 " in slurm.run("scontrol", "--oneliner", "show", "job", job_id)
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=2)
    assert_same_weights(ddp_weights, tmp_path / "model.pt")


def test_docs_show_the_commands_that_the_test_runs():
    page = (ROOT / "docs" / "slurm.md").read_text()
    for script, options in JOBS.items():
        assert shlex.join(["sbatch", *options, script, *SLURM_JOB_ARGS]) in page
