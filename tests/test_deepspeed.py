"""Step 05 as users launch it on the CPU: torchrun, the deepspeed launcher and plain python, ZeRO stages
0-3, exact evaluation, fp32 model.pt, the same optimizer steps as DDP, exact resume, one-line errors.

The first DeepSpeed run on a machine compiles a small C++ op (1-2 minutes on 2 cores, then cached in
~/.cache/torch_extensions): the module's first fixture does it once, so that no smoke run's timeout
has to cover it.
"""

import os
import socket

import pytest
from helpers import (
    BIN,
    FAST,
    ON_GPU,
    STEPS,
    assert_same_weights,
    check_ok,
    check_one_error,
    check_run,
    python,
    read_metrics,
    run,
    torchrun,
)

SCRIPT = "05_cifar10_deepspeed.py"
# The environment's bin first on PATH, as when it is activated: DeepSpeed builds and loads its op with
# the ninja installed beside it (it fails without one on PATH, even with the op cached), and always
# the same ninja (two ninja versions disagree about the cached build and rebuild it every time).
ENV = {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed(nproc, script, *args):
    # On a CPU --num_gpus is the number of processes. A free port instead of the launcher's fixed
    # default (29500), so that concurrent jobs cannot collide.
    return [str(BIN / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={free_port()}", script, *map(str, args)]


LAUNCH = {"torchrun": torchrun, "deepspeed": deepspeed, "python": lambda nproc, *args: python(*args)}


def launch(launcher, nproc, *args, timeout=180):
    # torchrun gives each worker one thread; the deepspeed launcher leaves that to us (2 processes with
    # all the cores each run several times slower than with one each).
    env = {**ENV, "OMP_NUM_THREADS": "1"} if launcher == "deepspeed" else ENV
    return run(LAUNCH[launcher](nproc, SCRIPT, *args), timeout=timeout, env=env)


@pytest.fixture(scope="module", autouse=True)
def deepspeed_op():
    """Compile DeepSpeed's CPU communication op once, as the script would (a no-op once cached)."""
    check_ok(run(python("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"), timeout=600, env=ENV))


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    """model.pt of step 04 (DDP, 2 processes) after the smoke run's steps."""
    output_dir = tmp_path_factory.mktemp("ddp")
    check_ok(run(torchrun(2, "04_cifar10_ddp.py", *FAST, "--max-steps", STEPS, "--output-dir", output_dir)))
    return output_dir / "model.pt"


@pytest.mark.parametrize("launcher, nproc, zero_stage, amp", [
    ("torchrun", 2, None, "none"),  # the config file's stage (2)
    ("torchrun", 3, 3, "bf16"),
    ("deepspeed", 2, 0, "none"),
    ("deepspeed", 3, 1, "none"),
    ("python", 1, None, "none"),  # no launcher: a world of one
])
def test_deepspeed_step(launcher, nproc, zero_stage, amp, ddp_weights, tmp_path):
    stage_args = [] if zero_stage is None else ["--zero-stage", zero_stage]
    result = check_ok(launch(launcher, nproc, *FAST, "--max-steps", STEPS, *stage_args, "--amp", amp,
                             "--output-dir", tmp_path))
    metrics = check_run(tmp_path, SCRIPT, world_size=nproc, amp=amp)
    assert metrics["zero_stage"] == (2 if zero_stage is None else zero_stage)
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    if nproc == 2 and not ON_GPU:
        # The engine takes exactly DDP's steps: same batches, same averaged gradients, same SGD.
        assert_same_weights(tmp_path / "model.pt", ddp_weights)


def test_resume_with_zero3_matches_uninterrupted_run(tmp_path):
    """N steps, then resumed to 2N (both mid-epoch), equals 2N in one go: every rank saves and reloads its
    own shard of the weights and the optimizer state, and `latest` names the newest complete checkpoint."""
    stop, end = 30, 60
    args = [*FAST, "--zero-stage", 3]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(launch("torchrun", 2, *args, "--max-steps", end, "--output-dir", straight))
    check_ok(launch("torchrun", 2, *args, "--max-steps", stop, "--save-every", 20, "--output-dir", stopped))
    checkpoints = stopped / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"step{stop}"
    assert [path.name for path in checkpoints.iterdir() if path.is_dir()] == [f"step{stop}"]  # step20 removed
    resumed = check_ok(launch("torchrun", 2, *args, "--max-steps", end, "--save-every", 20, "--resume",
                              "--output-dir", stopped))
    assert f"resumed from step {stop}" in resumed.stdout
    assert_same_weights(straight / "model.pt", stopped / "model.pt")
    a, b = read_metrics(straight), read_metrics(stopped)
    assert (a["steps"], a["epochs_completed"]) == (b["steps"], b["epochs_completed"]) == (end, 0)
    assert (a["test_loss"], a["test_accuracy"]) == (b["test_loss"], b["test_accuracy"])


@pytest.mark.parametrize("launcher, nproc, args, message", [
    ("deepspeed", 3, ["--batch-size", 32], "--batch-size 32 is not divisible by the world size 3"),
    ("python", 1, ["--deepspeed-config", "missing.json"], "--deepspeed-config missing.json: "),
    ("python", 1, ["--resume"], "--resume: no checkpoint in"),
])
def test_bad_input_is_one_line(launcher, nproc, args, message, tmp_path):
    result = launch(launcher, nproc, *FAST, *args, "--output-dir", tmp_path, timeout=120)
    check_one_error(result, message)
    assert not (tmp_path / "metrics.json").exists()

