"""Step 11 as users launch it on the CPU: expert parallelism under torchrun, a group of 2 (the default) and a
group of 4 at top-1; exact evaluation, the whole model in model.pt, every token's top-k assignments reported;
sharded checkpoints, at ep 2 with 2 copies of the experts, that resume exactly, dropout included. Parity with a
world of one, in float64, is in tests/test_parity.py, a killed worker and preemption in tests/test_faults.py, bad
input in tests/test_errors.py."""

import functools

import pytest
from jobs import SMALL_VIT, SMOKE_STEPS, SYNTHETIC_ARGS, VIT_LR, run_job
from launch import forked, torchrun
from outputs import check_ok, check_outputs, check_smoke_run, read_metrics
from resume import check_exact_resume, check_only_the_last_checkpoint_kept

from common import models

pytestmark = pytest.mark.full  # the full tier: the quick tier holds 11 by its parity row and bad-input rows

SCRIPT = "11_cifar10_expert_parallel.py"
RUN_ARGS = [*SYNTHETIC_ARGS, *VIT_LR]
TOKENS_PER_IMAGE = models.VIT_TOKENS


@pytest.mark.parametrize("nproc, extra, ep_size, top_k", [
    (2, [], 2, 2),  # the defaults: 8 experts, top-2, ep 2
    # 2 experts per rank, one per token. 2 copies of ep 2 run in the resume test below.
    (4, ["--ep-size", 4, "--top-k", 1], 4, 1),
])
def test_expert_parallel_step(nproc, extra, ep_size, top_k, tmp_path):
    # Learning is shown at 2 processes; at 4, a few steps show the outputs (their steps equal a world of one's:
    # the parity row "11 x4", at top-2).
    steps = SMOKE_STEPS if nproc == 2 else 5
    result = check_ok(run_job(torchrun(nproc, SCRIPT, *RUN_ARGS, *extra, "--max-steps", steps,
                                       "--output-dir", tmp_path)))
    # model.pt: the whole fp32 model, gathered from every rank's shards, that a plain module loads.
    model_class = functools.partial(models.VisionTransformer, experts=8, top_k=top_k)
    check = check_smoke_run if nproc == 2 else check_outputs
    check(tmp_path, SCRIPT, world_size=nproc, model_class=model_class, steps=steps)
    metrics = read_metrics(tmp_path)
    assert (metrics["ep_size"], metrics["top_k"]) == (ep_size, top_k)
    # The report: every token's top-k assignments of every step, in every block (that none is dropped on its
    # way to an expert, the parity rows show: one process has no way to drop one).
    routed = metrics["tokens_per_expert"]
    assert len(routed) == 6 and all(len(block) == 8 for block in routed), routed
    assert {sum(block) for block in routed} == {steps * metrics["global_batch_size"] * TOKENS_PER_IMAGE * top_k}
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    assert f"tokens per expert {[sum(column) for column in zip(*routed, strict=True)]}" in result.stdout


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """ep 2 with 2 copies, with dropout: each rank writes its shards of the weights (its experts' included) and
    optimizer state, the masks come from (seed, step, rank), so the resumed run drops what the uninterrupted run
    dropped. Started again, the finished run stands."""
    stopped, _ = check_exact_resume(lambda *args: forked(4, SCRIPT, *args, *SMALL_VIT, *VIT_LR), tmp_path, again=True)
    check_only_the_last_checkpoint_kept(stopped)
