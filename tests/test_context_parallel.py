"""Step 10 as users launch it on the CPU: context parallelism under torchrun, alone (a group of 2) and with
2 groups (cp 2 x dp 2), exact evaluation, the whole model in model.pt, sharded checkpoints that resume exactly,
dropout included, and label smoothing. Parity with 09 in a world of one, in float64, is in tests/test_parity.py,
a killed worker and preemption in tests/test_faults.py, bad input in tests/test_errors.py."""

import pytest
from jobs import SMALL_VIT, SMOKE_STEPS, SYNTHETIC_ARGS, VIT_LR, run_job
from launch import forked, torchrun
from outputs import check_ok, check_outputs, check_smoke_run, read_metrics
from resume import check_exact_resume, check_only_the_last_checkpoint_kept

from common import models

pytestmark = pytest.mark.full  # the full tier: the quick tier holds 10 by its parity row and a bad-input row

SCRIPT = "10_cifar10_context_parallel.py"
RUN_ARGS = [*SYNTHETIC_ARGS, *VIT_LR]


@pytest.mark.parametrize("nproc", [2, 4])  # cp 2 (the default), and cp 2 x dp 2
def test_context_parallel_step(nproc, tmp_path):
    # Learning is shown at 2 processes; at 4, a few steps show the outputs of the 2D mesh (its steps equal a
    # world of one's: the parity row "10 2x2"), with --label-smoothing.
    steps, extra = (SMOKE_STEPS, []) if nproc == 2 else (5, ["--label-smoothing", 0.1])
    result = check_ok(run_job(torchrun(nproc, SCRIPT, *RUN_ARGS, *extra, "--max-steps", steps,
                                       "--output-dir", tmp_path)))
    # model.pt: the whole fp32 model, gathered from every rank's shards, that a plain module loads.
    check = check_smoke_run if nproc == 2 else check_outputs
    check(tmp_path, SCRIPT, world_size=nproc, model_class=models.VisionTransformer, steps=steps)
    assert read_metrics(tmp_path)["cp_size"] == 2
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """cp 2 x dp 2, with dropout: each rank writes its shards of the weights and optimizer state, the masks
    come from (seed, step, rank), so the resumed run drops what the uninterrupted run dropped. Started again,
    the finished run stands."""
    stopped, _ = check_exact_resume(lambda *args: forked(4, SCRIPT, *args, *SMALL_VIT, *VIT_LR), tmp_path, again=True)
    check_only_the_last_checkpoint_kept(stopped)
