"""Step 09 as users launch it on the CPU: tensor and sequence parallelism under torchrun, alone (a group of 2)
and with FSDP2 across 2 groups (tp 2 x dp 2), exact evaluation, the whole model in model.pt, sharded
checkpoints that resume exactly, dropout included, and label smoothing, which loss_parallel does not take.
Parity with 09 in a world of one, in float64, is in tests/test_parity.py, a killed worker in
tests/test_faults.py, bad input in tests/test_errors.py."""

import datetime

import pytest
import torch
import torch.nn.functional as F
from jobs import SMALL_VIT, SMOKE_STEPS, SYNTHETIC_ARGS, VIT_LR, run_job
from launch import forked, in_local_processes, torchrun
from outputs import check_ok, check_outputs, check_smoke_run, read_metrics
from resume import check_exact_resume, check_only_the_last_checkpoint_kept
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

from common import distributed, models

pytestmark = pytest.mark.full  # the full tier: the quick tier holds 09 by its parity rows

SCRIPT = "09_cifar10_tensor_parallel.py"
RUN_ARGS = [*SYNTHETIC_ARGS, *VIT_LR]
SMOOTHING = 0.1


@pytest.mark.parametrize("nproc", [2, 4])  # tp 2 (the default), and tp 2 x dp 2
def test_tensor_parallel_step(nproc, tmp_path):
    # Learning is shown at 2 processes; at 4, a few steps show the outputs of the 2D mesh (its steps equal a
    # world of one's: the parity row "09 2x2"), with --label-smoothing, which loss_parallel does not take.
    steps, extra = (SMOKE_STEPS, []) if nproc == 2 else (5, ["--label-smoothing", SMOOTHING])
    result = check_ok(run_job(torchrun(nproc, SCRIPT, *RUN_ARGS, *extra, "--max-steps", steps,
                                       "--output-dir", tmp_path)))
    # model.pt: the whole fp32 model, gathered from both mesh dimensions, that a plain module loads.
    check = check_smoke_run if nproc == 2 else check_outputs
    check(tmp_path, SCRIPT, world_size=nproc, model_class=models.VisionTransformer, steps=steps)
    assert read_metrics(tmp_path)["tp_size"] == 2
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    assert "redistributing" not in result.stderr  # gathering model.pt, torch's warning on every rank: silenced


def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """tp 2 x dp 2, with dropout: each rank writes its shards of the weights and optimizer state, the masks
    come from (seed, step, rank), so the resumed run drops what the uninterrupted run dropped. Started again,
    the finished run stands."""
    stopped, _ = check_exact_resume(lambda *args: forked(4, SCRIPT, *args, *SMALL_VIT, *VIT_LR), tmp_path, again=True)
    check_only_the_last_checkpoint_kept(stopped)


def label_smoothing_differences(rank):
    """|09's smoothed loss and its gradient - F.cross_entropy's with label_smoothing| on one rank of a tp group
    of 2, in float64 (loss_parallel takes no label_smoothing: 09 adds its term, `distributed.smoothing_term`)."""
    mesh = init_device_mesh("cpu", (2,))
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 10, dtype=torch.float64, generator=generator, requires_grad=True)
    labels = torch.randint(0, 10, (6,), generator=generator)
    expected = F.cross_entropy(logits, labels, label_smoothing=SMOOTHING)
    expected.backward()
    sharded = distribute_tensor(logits.detach(), mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        nll = F.cross_entropy(sharded, labels, reduction="none")
        loss = (nll + SMOOTHING * distributed.smoothing_term(sharded, labels)).mean()
        loss.backward()
    return (abs(loss.full_tensor() - expected).item(), (sharded.grad.full_tensor() - logits.grad).abs().max().item())


def test_label_smoothing_is_torchs_with_the_classes_split():
    for loss_difference, gradient_difference in in_local_processes(label_smoothing_differences, 2,
                                                                    datetime.timedelta(seconds=60)).values():
        assert loss_difference < 1e-12 and gradient_difference < 1e-12, (loss_difference, gradient_difference)
