"""Step 07 as users launch it on the CPU: FSDP2 under torchrun with 2 and 3 processes, exact
evaluation, a full fp32 model.pt, DDP's optimizer steps, sharded checkpoints that resume exactly,
one-line errors. Parity with 01 in float64 is in tests/test_parity.py, resuming at another world size
in tests/test_resume.py."""

import re

import pytest
from jobs import SMALL_RESNET9, SMOKE_ARGS, SYNTHETIC_ARGS, run_job, sized_for
from launch import ON_GPU, forked, python, torchrun
from outputs import assert_same_weights, check_ok, check_one_error, check_smoke_run
from resume import END_STEP, check_another_norm_is_refused, check_exact_resume, check_only_the_last_checkpoint_kept

SCRIPT = "07_cifar10_fsdp.py"


@pytest.mark.full
@pytest.mark.parametrize("nproc, amp", [(2, "none"), (3, "bf16")])
def test_fsdp_step(nproc, amp, request, tmp_path):
    size, timeout, width = sized_for(amp)
    result = check_ok(run_job(torchrun(nproc, SCRIPT, *SMOKE_ARGS, *size, "--amp", amp, "--output-dir", tmp_path),
                              timeout=timeout))
    check_smoke_run(tmp_path, SCRIPT, world_size=nproc, amp=amp, width=width)  # model.pt: the whole model, in fp32
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    if nproc == 2 and not ON_GPU:
        # Sharded, 07 takes exactly 04's steps: the same batches, the same averaged gradients
        # (reduce-scattered instead of all-reduced), the same SGD on each shard.
        assert_same_weights(tmp_path / "model.pt", request.getfixturevalue("ddp_weights"))


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """Every rank saves and reloads its own shard of the weights and the optimizer state; `latest` names
    the newest complete checkpoint, and the older ones are removed. Started again, the finished run stands;
    with GroupNorm instead of its BatchNorm (whose affine weights DCP would load silently), it stops in one line."""
    def launch(*args):
        return forked(2, SCRIPT, *args, *SMALL_RESNET9)
    stopped, args = check_exact_resume(launch, tmp_path, again=True)
    check_only_the_last_checkpoint_kept(stopped)
    shards = sorted(path.name for path in (stopped / "checkpoints" / f"step{END_STEP}").glob("*.distcp"))
    assert shards == ["__0_0.distcp", "__1_0.distcp"]  # one file per rank
    check_another_norm_is_refused(launch, args, stopped)


@pytest.mark.full
@pytest.mark.parametrize("nproc, args, message", [
    (3, ["--batch-size", 32], "--batch-size 32 is not divisible by the world size 3"),
    (1, ["--resume"], "--resume: no checkpoint in"),
])
def test_bad_input_is_one_line(nproc, args, message, tmp_path):
    command = [*SYNTHETIC_ARGS, *args, "--output-dir", tmp_path]
    result = run_job(torchrun(nproc, SCRIPT, *command) if nproc > 1 else python(SCRIPT, *command), timeout=120)
    check_one_error(result, message)
    assert not (tmp_path / "metrics.json").exists()


@pytest.mark.full
def test_an_overflow_in_one_shard_skips_the_step_on_every_rank():
    """07 uses torch's own GradScaler (not ShardedGradScaler): FSDP2's gradients are DTensors, whose
    overflow check takes the maximum over the ranks."""
    result = check_ok(run_job(torchrun(2, "tests/fsdp_overflow.py"), timeout=120))
    assert sorted(re.findall(r"rank \d stepped \w+ scale \S+", result.stdout)) == [
        "rank 0 stepped False scale 512.0", "rank 1 stepped False scale 512.0"]
