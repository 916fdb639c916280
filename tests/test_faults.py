"""Faults, for real: a worker killed in the middle of an elastic run, a preemption (SIGTERM or SIGUSR1 to
torchrun, a signal to one worker), a crash in the middle of a checkpoint write. Each job must end with the
weights of a run that nothing interrupted. And a run that finished must exit 0, whatever the process group's
threads are still doing.

The preemption runs keep the default loader workers (2 per rank): the signal reaches them too, as it does a
user's job. The quick tier signals one worker's process group (the worker and its loader workers); the full tier
signals torchrun for every step, SIGTERM and SIGUSR1 in turn, and one worker alone."""

import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest
from jobs import MNIST_LR, SYNTHETIC_ARGS, VIT_LR, catches, loader_workers, run_job, with_default_workers, workers
from launch import ROOT, forked, python, torchrun
from outputs import assert_same_weights, check_ok, check_signalled_torchrun, resumed_steps, saved_step, trained_once

# 30 steps of an epoch of 100, with a checkpoint every 10. The job is signalled once the checkpoint of step
# KILL_AFTER_STEP exists and stops a step or two later; resumed, its worker is killed at the next checkpoint,
# with 10 steps to spare: the job has something to resume from and something left to do. The default loader
# workers; a global batch of 24 (not 256) makes a step take a fraction of a second, so that a signal lands in
# the middle of an epoch.
FAULT_RUN_STEPS, KILL_AFTER_STEP, SAVE_EVERY = 30, 10, 10
FAULT_RUN_ARGS = [*with_default_workers(SYNTHETIC_ARGS), "--max-steps", FAULT_RUN_STEPS, "--save-every", SAVE_EVERY]
# torchrun passes these signals on to its workers; SIGUSR1 only when told to (docs/fault-tolerance.md).
HANDLED_SIGNALS = ["--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"]
# The elastic launch of docs/fault-tolerance.md (which says why the variable is needed).
ELASTIC_OPTIONS, ELASTIC_ENV = ["--max-restarts=1"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def latest_step(output_dir):
    """The step of the checkpoint that `checkpoints/latest` names (05, 07-11)."""
    return int((output_dir / "checkpoints" / "latest").read_text().removeprefix("step"))


# Each step's extra arguments, and how to read the step of its last complete checkpoint. Half the default widths:
# a quarter of the arithmetic of each of the 4 runs of a fault job (what happens to a signal does not depend on
# it), and steps still slow enough that the job stops well before its end.
HALF_WIDTH = {"resnet9": ["--width", 16], "vit": ["--width", 64]}
STEPS = {
    "04_cifar10_ddp.py": (HALF_WIDTH["resnet9"], saved_step),
    "05_cifar10_deepspeed.py": (HALF_WIDTH["resnet9"], latest_step),
    "06_mnist_accelerate.py": (MNIST_LR, saved_step),
    "07_cifar10_fsdp.py": (HALF_WIDTH["resnet9"], latest_step),
    "08_cifar10_pipeline.py": (HALF_WIDTH["resnet9"], latest_step),
    "09_cifar10_tensor_parallel.py": ([*HALF_WIDTH["vit"], *VIT_LR], latest_step),
    "10_cifar10_context_parallel.py": ([*HALF_WIDTH["vit"], *VIT_LR], latest_step),
    "11_cifar10_expert_parallel.py": ([*HALF_WIDTH["vit"], *VIT_LR], latest_step),
}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """uninterrupted(script): model.pt of the fault runs' job without a fault (forked: what it computes is the
    claim, not how it starts)."""
    return trained_once(tmp_path_factory, lambda script, output_dir: forked(
        2, script, *FAULT_RUN_ARGS, *STEPS[script][0], "--output-dir", output_dir))


def once_checkpointed(output_dir, read_step, step, action):
    """A `poll` for run_job: `action(process)`, once, as soon as the checkpoint of `step` (or a later one) is
    complete. Returns the poll and the list of what `action` returned (empty: never run)."""
    done = []

    def poll(process):
        try:
            saved = read_step(output_dir)
        except (OSError, ValueError):  # not written yet
            return
        if not done and saved >= step:
            done.append(action(process))

    return poll, done


def preempted_step(result, output_dir, read_step):
    """The step after which a signalled job stopped: named by rank 0's one `preempted:` line, and the step of
    the checkpoint it left. Stopped with steps to spare, after the checkpoint that triggered the signal."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("preempted: ")]
    assert len(lines) == 1, result.stderr[-5000:]
    step = int(re.search(r"stopped after step (\d+) ", lines[0]).group(1))
    assert KILL_AFTER_STEP <= step and read_step(output_dir) == step, (lines, read_step(output_dir))
    # The resumed run's worker is killed at the next checkpoint, which must come before the end of the run.
    assert step < FAULT_RUN_STEPS - SAVE_EVERY, f"the signal came too late (step {step}) to kill a worker after it"
    return step


def test_a_signal_to_one_workers_process_group_stops_every_rank_at_one_step_and_resumes_exactly(uninterrupted,
                                                                                             tmp_path):
    """Preemption with the default loader workers, as torchrun delivers a signal to each worker: SIGTERM to rank
    1's process group, that is rank 1 and its 2 loader workers, once they all run. The loader workers ignore it
    (PyTorch's own handler would end them, and rank 1 with them); rank 1's flag reaches rank 0 through the next
    step's agreement; both save a checkpoint at that step and exit 75. `--resume` ends with the uninterrupted
    run's weights, bit for bit."""
    script = "04_cifar10_ddp.py"
    signalled, blocked = [], []

    def sigterm_once_loading(process):
        rank1 = workers(process).get(1)
        if not signalled and rank1 and catches(rank1, signal.SIGTERM) and len(loader_workers(rank1)) >= 2:
            # Whether a worker that dies of it fails the run depends on the batches it had loaded: look at the block.
            blocked.extend(catches(worker, signal.SIGTERM, mask="SigBlk") for worker in loader_workers(rank1))
            os.killpg(rank1, signal.SIGTERM)  # torchrun starts each worker in a process group of its own
            signalled.append(rank1)

    fault_run_args = [*FAULT_RUN_ARGS, *STEPS[script][0]]
    result = run_job(torchrun(2, script, *fault_run_args, "--output-dir", tmp_path), poll=sigterm_once_loading,
                     timeout=180)
    assert signalled, "the run ended before rank 1's loader workers were seen"
    assert blocked and all(blocked), f"a loader worker of rank 1 does not block SIGTERM, so dies of it: {blocked}"
    assert result.returncode == 1 and len(re.findall(r"exitcode\s*: 75 ", result.stderr)) == 2, result.stderr[-5000:]
    assert "DataLoader worker" not in result.stderr, result.stderr[-5000:]
    # torchrun's failure table: the line each rank recorded. Rank 0 was not signalled: it learned from rank 1.
    reasons = sorted(re.findall(r"traceback : preempted: (.*?) received; every rank stopped after step (\d+) ",
                                result.stderr))
    assert [reason for reason, _ in reasons] == ["SIGTERM", "a signal to another rank"], result.stderr[-5000:]
    step = int(reasons[0][1])
    assert reasons[1][1] == str(step) and 0 < step < FAULT_RUN_STEPS and saved_step(tmp_path) == step, reasons
    assert not (tmp_path / "model.pt").exists()  # a stopped run writes no final outputs
    resumed = check_ok(run_job(torchrun(2, script, *fault_run_args, "--resume", "--output-dir", tmp_path)))
    assert resumed_steps(resumed.stdout) == [step], resumed.stdout[-2000:]
    assert_same_weights(uninterrupted(script), tmp_path / "model.pt")


@pytest.mark.full
@pytest.mark.parametrize("script, number", [(script, (signal.SIGTERM, signal.SIGUSR1)[index % 2])
                                            for index, script in enumerate(STEPS)], ids=lambda value: str(value))
def test_preempted_then_killed_job_resumes_each_time_to_the_uninterrupted_weights(script, number, uninterrupted,
                                                                                tmp_path):
    """Two faults in one job, each checked where it happens (one job, not two: each costs a whole run).

    1. Preemption, as a scheduler does it: SIGTERM or SIGUSR1 (the steps in turn: the handler and the loader
       workers' are common/'s, the save at the agreed step is each step's own) to torchrun once the checkpoint of
       step 10 exists. torchrun passes it to every worker's process group, loader workers included, and gives
       them 30 s (--shutdown-timeout) before SIGKILL; the workers agree on a step, save there and exit 75;
       torchrun, signalled, exits 1 (or aborts: check_signalled_torchrun).
    2. A dead worker: the same command with --resume, under torchrun --max-restarts=1. Once a checkpoint later
       than the preempted one exists, rank 1 dies by SIGKILL; torchrun restarts the group, which resumes by
       itself from the last checkpoint.
    The job ends with the weights of the run that nothing stopped, bit for bit."""
    extra_args, checkpoint_step = STEPS[script]
    command = torchrun(2, script, *FAULT_RUN_ARGS, *extra_args, "--output-dir", tmp_path, options=HANDLED_SIGNALS)
    poll, signalled = once_checkpointed(tmp_path, checkpoint_step, KILL_AFTER_STEP,
                                        lambda process: os.kill(process.pid, number))
    stopped = run_job(command, poll=poll, timeout=300)
    assert signalled, f"the run ended before a checkpoint of step {KILL_AFTER_STEP} was seen"
    check_signalled_torchrun(stopped, number)
    assert "DataLoader worker" not in stopped.stderr, stopped.stderr[-5000:]
    step = preempted_step(stopped, tmp_path, checkpoint_step)
    assert not (tmp_path / "model.pt").exists()  # a stopped run writes no final outputs

    poll, killed = once_checkpointed(tmp_path, checkpoint_step, step + 1,
                                     lambda process: os.kill(workers(process)[1], signal.SIGKILL))
    elastic = torchrun(2, script, *FAULT_RUN_ARGS, *extra_args, "--resume", "--output-dir", tmp_path,
                       options=ELASTIC_OPTIONS)
    result = check_ok(run_job(elastic, env=ELASTIC_ENV, poll=poll, timeout=300))
    assert killed, f"the resumed run ended before a checkpoint after step {step} was seen"
    # torchrun saw the group fail once and restarted it once, which resumed by itself. The failure it
    # names is the earliest by a timestamp in whole seconds: the killed worker, or the survivor whose
    # next collective broke in the same second, so the line's exit code is not checked.
    assert result.stderr.count("failed (exitcode: ") == 1, result.stderr[-3000:]
    resumed = resumed_steps(result.stdout)
    assert len(resumed) == 2 and resumed[0] == step < resumed[1] < FAULT_RUN_STEPS, result.stdout
    assert_same_weights(uninterrupted(script), tmp_path / "model.pt")


@pytest.mark.full
def test_a_signal_to_one_worker_stops_every_worker_at_one_step(tmp_path):
    """SIGUSR1 to rank 1 alone: rank 0 learns of it in the next step's agreement, and both write their shards
    of 07's checkpoint (a collective save: a rank that stopped alone would leave the other waiting in it until
    the process group's timeout) and exit 75. torchrun was not signalled: it reports the failed workers."""
    script = "07_cifar10_fsdp.py"
    extra_args, checkpoint_step = STEPS[script]
    poll, signalled = once_checkpointed(tmp_path, checkpoint_step, KILL_AFTER_STEP,
                                        lambda process: os.kill(workers(process)[1], signal.SIGUSR1))
    result = run_job(torchrun(2, script, *FAULT_RUN_ARGS, *extra_args, "--output-dir", tmp_path), poll=poll,
                     timeout=120)
    assert signalled, f"the run ended before a checkpoint of step {KILL_AFTER_STEP} was seen"
    step = preempted_step(result, tmp_path, checkpoint_step)
    # torchrun's failure table: each rank's exit status, and the line it recorded (which step it stopped after).
    assert result.returncode == 1 and len(re.findall(r"exitcode\s*: 75 ", result.stderr)) == 2, result.stderr[-5000:]
    reasons = sorted(re.findall(r"traceback : preempted: (.*?) received; every rank stopped after step (\d+) ",
                                result.stderr))
    assert reasons == [("SIGUSR1", str(step)), ("a signal to another rank", str(step))], reasons
    assert (tmp_path / "checkpoints" / f"step{step}" / ".metadata").is_file()


@pytest.mark.full
def test_sigterm_to_one_process_without_a_process_group_saves_and_exits_75(tmp_path):
    """06 under plain `python`: Accelerate on one process creates no process group, and the flag alone decides.
    SIGTERM once the process handles it (before that, it would end it): a checkpoint at that step, exit 75."""
    signalled = []

    def sigterm_once_caught(process):
        if not signalled and catches(process.pid, signal.SIGTERM):
            os.kill(process.pid, signal.SIGTERM)
            signalled.append(process.pid)

    command = python("06_mnist_accelerate.py", *FAULT_RUN_ARGS, *MNIST_LR, "--output-dir", tmp_path)
    result = run_job(command, poll=sigterm_once_caught, timeout=180)
    assert signalled and result.returncode == 75, result.stderr[-3000:]
    [step] = re.findall(r"^preempted: SIGTERM received; every rank stopped after step (\d+) ", result.stderr, re.M)
    assert 0 < int(step) < FAULT_RUN_STEPS and saved_step(tmp_path) == int(step)
    assert not (tmp_path / "model.pt").exists()


# Save a checkpoint with common/utils.save_atomic, as the script does, but die by SIGKILL once half
# of the file is on the disk: a real crash, at a known point in the middle of the write.
CRASH_WHILE_SAVING = """
import io, os, signal, sys
import torch
from common import utils

def save_half_then_die(obj, file):
    buffer = io.BytesIO()
    torch_save(obj, buffer)
    file.write(buffer.getvalue()[:buffer.tell() // 2])
    file.flush()
    os.kill(os.getpid(), signal.SIGKILL)

checkpoint = torch.load(sys.argv[1], weights_only=True)
checkpoint["step"] += 10  # the next checkpoint, which never lands
torch_save, torch.save = torch.save, save_half_then_die
utils.save_atomic(checkpoint, sys.argv[1])
"""


@pytest.mark.full
def test_crash_while_writing_a_checkpoint_leaves_the_previous_one_resumable(uninterrupted, tmp_path):
    script = "04_cifar10_ddp.py"
    stop = ["--max-steps", KILL_AFTER_STEP]
    check_ok(run_job(torchrun(2, script, *SYNTHETIC_ARGS, *STEPS[script][0], *stop, "--save-every", 10,
                              "--output-dir", tmp_path)))
    checkpoint = tmp_path / "checkpoint.pt"
    good = checkpoint.read_bytes()
    crashed = run_job(python("-c", CRASH_WHILE_SAVING, checkpoint))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    # The crash left its half-written temporary file, beside the previous checkpoint, untouched.
    [partial] = tmp_path.glob(".checkpoint.pt.*.tmp")
    assert 0 < partial.stat().st_size < len(good)
    assert checkpoint.read_bytes() == good
    resumed = check_ok(run_job(torchrun(2, script, *FAULT_RUN_ARGS, *STEPS[script][0], "--resume",
                                        "--output-dir", tmp_path)))
    assert resumed_steps(resumed.stdout) == [KILL_AFTER_STEP], resumed.stdout[-2000:]
    assert_same_weights(uninterrupted(script), tmp_path / "model.pt")


# The end of a distributed run, reduced to its hazard: the last collective completes just before main()
# returns, and main() leaves the process group alive. Python's shutdown can then abort the process with
# SIGABRT ("terminate called without an active exception") while a gloo thread still runs: utils.run
# destroys the group first (its docstring).
LAST_COLLECTIVE_SCRIPT = """
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, {root!r})
from common import utils


def main():
    dist.init_process_group("gloo")
    dist.all_reduce(torch.ones(1000))


utils.run(main)
"""


@pytest.mark.full
def test_a_finished_run_exits_0_while_the_process_group_is_alive(tmp_path):
    script = tmp_path / "last_collective.py"
    script.write_text(LAST_COLLECTIVE_SCRIPT.format(root=str(ROOT)))
    # A race: without the group's destruction, some runs in 10 abort. Two jobs at a time: each spends most of
    # its time starting Python, and the race is the workers' own.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for result in pool.map(lambda _: run_job(torchrun(2, script), timeout=60), range(10)):
            check_ok(result)
