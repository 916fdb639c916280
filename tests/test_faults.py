"""Faults, for real: a worker killed in the middle of an elastic run, a crash in the middle of a
checkpoint write. Both jobs must end with the weights of a run that nothing interrupted."""

import os
import signal

import pytest
from helpers import FAST, assert_same_weights, check_ok, load_state, python, run, torchrun, workers

SCRIPT = "04_cifar10_ddp.py"
# Half an epoch with a checkpoint every 10 steps. The fault comes after the checkpoint of step
# FAULT_AT, with steps to spare before the end, so the job has something to resume from and
# something left to do.
END, FAULT_AT = 50, 20
ARGS = [*FAST, "--max-steps", END, "--save-every", 10]
# The README's elastic launch (section "Elastic restarts" says why the variable is needed).
ELASTIC_OPTIONS, ELASTIC_ENV = ["--max-restarts=1"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("uninterrupted")
    check_ok(run(torchrun(2, SCRIPT, *ARGS, "--output-dir", output_dir)))
    return output_dir / "model.pt"


def test_killed_worker_is_restarted_and_resumes_from_the_last_checkpoint(uninterrupted, tmp_path):
    checkpoint, killed = tmp_path / "checkpoint.pt", []

    def kill_rank_1_after_a_checkpoint(process):
        if not killed and checkpoint.exists() and load_state(checkpoint)["step"] >= FAULT_AT:
            pid = workers(process)[1]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    command = torchrun(2, SCRIPT, *ARGS, "--output-dir", tmp_path, options=ELASTIC_OPTIONS)
    result = check_ok(run(command, env=ELASTIC_ENV, poll=kill_rank_1_after_a_checkpoint))
    assert killed, f"the run ended before a checkpoint of step {FAULT_AT} was seen"
    # torchrun saw the killed worker fail, and restarted the group once, which resumed by itself.
    assert result.stderr.count("failed (exitcode: -9)") == 1, result.stderr[-3000:]
    resumed = [line for line in result.stdout.splitlines() if line.startswith("resumed from step")]
    assert len(resumed) == 1, result.stdout
    assert FAULT_AT <= int(resumed[0].split()[-1]) < END
    assert_same_weights(uninterrupted, tmp_path / "model.pt")


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


def test_crash_while_writing_a_checkpoint_leaves_the_previous_one_resumable(uninterrupted, tmp_path):
    check_ok(run(torchrun(2, SCRIPT, *FAST, "--max-steps", FAULT_AT, "--save-every", 10, "--output-dir", tmp_path)))
    checkpoint = tmp_path / "checkpoint.pt"
    good = checkpoint.read_bytes()
    crashed = run(python("-c", CRASH_WHILE_SAVING, checkpoint))
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    # The crash left its half-written temporary file, beside the previous checkpoint, untouched.
    [partial] = tmp_path.glob(".checkpoint.pt.*.tmp")
    assert 0 < partial.stat().st_size < len(good)
    assert checkpoint.read_bytes() == good
    resumed = check_ok(run(torchrun(2, SCRIPT, *ARGS, "--resume", "--output-dir", tmp_path)))
    assert f"resumed from step {FAULT_AT}" in resumed.stdout
    assert_same_weights(uninterrupted, tmp_path / "model.pt")
