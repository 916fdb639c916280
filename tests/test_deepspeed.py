"""Step 05 as users launch it on the CPU: torchrun, the deepspeed launcher and plain python, ZeRO stages
0-3, exact evaluation, fp32 model.pt, the same optimizer steps as DDP, exact resume, one-line errors.

The first DeepSpeed run on a machine compiles a small C++ op (1-2 minutes on 2 cores, then cached in
~/.cache/torch_extensions): the module's first fixture does it once, so that no smoke run's timeout
has to cover it.
"""

import pytest
from jobs import SMOKE_ARGS, SYNTHETIC_ARGS, run_job
from launch import LAUNCHERS, ON_GPU, python, torchrun
from outputs import assert_same_weights, check_ok, check_one_error, check_smoke_run
from resume import END_STEP, check_exact_resume

SCRIPT = "05_cifar10_deepspeed.py"


def launch(launcher, nproc, *args, timeout=180):
    # torchrun gives each worker one thread; the deepspeed launcher leaves that to us (2 processes with
    # all the cores each run several times slower than with one each).
    env = {"OMP_NUM_THREADS": "1"} if launcher == "deepspeed" else None
    return run_job(LAUNCHERS[launcher](nproc, SCRIPT, *args), timeout=timeout, env=env)


@pytest.fixture(scope="module", autouse=True)
def deepspeed_op():
    """Compile DeepSpeed's CPU communication op once, as the script would (a no-op once cached). On
    GPUs DeepSpeed communicates through NCCL and needs no such op."""
    if not ON_GPU:
        check_ok(run_job(python("-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"), timeout=600))


@pytest.fixture(scope="module")
def ddp_weights(tmp_path_factory):
    """model.pt of step 04 (DDP, 2 processes) after the smoke run's steps."""
    output_dir = tmp_path_factory.mktemp("ddp")
    check_ok(run_job(torchrun(2, "04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", output_dir)))
    return output_dir / "model.pt"


@pytest.mark.parametrize("launcher, nproc, zero_stage, amp", [
    ("torchrun", 2, None, "none"),  # the config file's stage (2)
    ("torchrun", 3, 3, "bf16"),
    ("deepspeed", 2, 0, "none"),
    ("deepspeed", 3, 1, "none"),
    ("python", 1, None, "none"),  # no launcher: a world of one
])
def test_deepspeed_step(launcher, nproc, zero_stage, amp, request, tmp_path):
    stage_args = [] if zero_stage is None else ["--zero-stage", zero_stage]
    result = check_ok(launch(launcher, nproc, *SMOKE_ARGS, *stage_args, "--amp", amp, "--output-dir", tmp_path))
    metrics = check_smoke_run(tmp_path, SCRIPT, world_size=nproc, amp=amp)
    assert metrics["zero_stage"] == (2 if zero_stage is None else zero_stage)
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    if nproc == 2 and not ON_GPU:
        # The engine takes exactly DDP's steps: same batches, same averaged gradients, same SGD.
        assert_same_weights(tmp_path / "model.pt", request.getfixturevalue("ddp_weights"))


def test_resume_with_zero3_matches_uninterrupted_run(tmp_path):
    """Stopped and resumed (both mid-epoch) equals one go: every rank saves and reloads its own shard of
    the weights and the optimizer state, and `latest` names the newest complete checkpoint."""
    stopped, args = check_exact_resume(lambda *args: torchrun(2, SCRIPT, *args, "--zero-stage", 3), tmp_path)
    checkpoints = stopped / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"step{END_STEP}"
    assert [path.name for path in checkpoints.iterdir() if path.is_dir()] == [f"step{END_STEP}"]  # older ones removed
    # ZeRO-3's shards fit 2 processes only: 3 are refused, in one line.
    result = run_job(torchrun(3, SCRIPT, *args, "--max-steps", END_STEP + 4, "--zero-stage", 3, "--resume",
                              "--output-dir", stopped), timeout=120)
    check_one_error(result, "its ZeRO shards were written by 2 processes and ZeRO cannot re-partition them for 3")


@pytest.mark.parametrize("launcher, nproc, args, message", [
    ("deepspeed", 3, ["--batch-size", 32], "--batch-size 32 is not divisible by the world size 3"),
    ("python", 1, ["--resume"], "--resume: no checkpoint in"),
    ("python", 1, ["--amp", "fp16"], "--amp fp16 needs a GPU"),  # as in 02-04, not a silent fallback
])
def test_bad_input_is_one_line(launcher, nproc, args, message, tmp_path):
    if "fp16" in args and ON_GPU:
        pytest.skip("a GPU machine accepts --amp fp16")
    result = launch(launcher, nproc, *SYNTHETIC_ARGS, *args, "--output-dir", tmp_path, timeout=120)
    check_one_error(result, message)
    assert not (tmp_path / "metrics.json").exists()
