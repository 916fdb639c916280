"""ddp_from_scratch.py: the wrapper takes the steps of torch's DistributedDataParallel, its broadcast makes
replicas that start different equal, and gradient accumulation with no_sync() equals one step on the whole
batch while all-reducing once per bucket.

Most runs compare weights as the parity check does (docs/parity.md): float64 (benchmarks/float64.py) and
--norm group. All run on a small data set (4 optimizer steps of 24 samples), so that the module stays quick.
"""

import parity
import pytest
from data_dirs import tiny_cifar10
from jobs import SHORT_RUN_ARGS
from launch import forked
from outputs import METRIC_KEYS, assert_same_weights, read_metrics, trained_once

from common import models

SCRIPT = "ddp_from_scratch.py"
STEPS = 4
TOLERANCE = 1e-12  # largest relative difference; these runs measure 0 to 1e-15
ACCUMULATION = 3  # 2 processes x 3 micro-batches of 4 samples = the global batch of 24


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained((ddp, nproc, accumulation, norm)): model.pt of that run; its metrics.json lies beside it.
    --norm group runs in float64, to compare weights (docs/parity.md); --norm batch as a user runs it."""
    data_dir = tiny_cifar10(tmp_path_factory.mktemp("ddp_from_scratch") / "data", train_size=STEPS * 24, test_size=10)

    def command(key, output_dir):
        ddp, nproc, accumulation, norm = key
        in_float64 = ["benchmarks/float64.py"] if norm == "group" else []
        # 1 MiB buckets: several per backward pass (ResNet-9's float64 gradients are 12.6 MiB), so that the
        # order in which they are launched and awaited matters.
        return forked(nproc, *in_float64, SCRIPT, "--data-dir", data_dir, *SHORT_RUN_ARGS,
                        "--norm", norm, "--bucket-cap-mb", 1, "--ddp", ddp,
                        "--gradient-accumulation-steps", accumulation, "--output-dir", output_dir)

    return trained_once(tmp_path_factory, command)


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.full)])
def test_the_wrapper_takes_the_steps_of_torchs_ddp(nproc, trained):
    difference = parity.max_relative_difference(trained(("scratch", nproc, 1, "group")),
                                                  trained(("torch", nproc, 1, "group")))
    assert difference <= TOLERANCE, f"{nproc} processes: {difference:.1e}"


@pytest.mark.full
@pytest.mark.parametrize("ddp, nproc", [("scratch", 2), ("scratch", 4), ("torch", 2)])
def test_replicas_that_start_different_end_equal(ddp, nproc, trained):
    """Each rank builds its model from another seed: only the broadcast at construction makes them equal."""
    metrics = read_metrics(trained((ddp, nproc, 1, "group")).parent)
    assert (metrics["ddp"], metrics["world_size"], metrics["steps"]) == (ddp, nproc, STEPS)
    assert metrics["replicas_equal_before_wrapping"] is False
    assert metrics["replicas_equal_at_end"] is True


@pytest.mark.full
@pytest.mark.parametrize("ddp", ["scratch", "torch"])
def test_accumulated_micro_batches_equal_one_step_on_the_whole_batch(ddp, trained):
    difference = parity.max_relative_difference(trained((ddp, 2, ACCUMULATION, "group")),
                                                  trained((ddp, 2, 1, "group")))
    assert difference <= TOLERANCE, f"{ddp}: {difference:.1e}"


@pytest.mark.full
@pytest.mark.parametrize("ddp", ["scratch", "torch"])
def test_no_sync_leaves_one_all_reduce_per_bucket_and_optimizer_step(ddp, trained):
    """Without no_sync(), each of the N backward passes would all-reduce every bucket: N times as many."""
    buckets = read_metrics(trained(("scratch", 2, 1, "group")).parent)["buckets"]
    assert buckets > 1
    # torch's DDP reduces its first backward pass in one bucket, then rebuilds its buckets in the order the
    # gradients arrived: the wrapper's order, and so its buckets.
    expected = {str(buckets): STEPS} if ddp == "scratch" else {"1": 1, str(buckets): STEPS - 1}
    for accumulation in (1, ACCUMULATION):
        metrics = read_metrics(trained((ddp, 2, accumulation, "group")).parent)
        assert metrics["gradient_accumulation_steps"] == accumulation
        assert metrics["steps_by_all_reduces"] == expected


@pytest.mark.full
def test_with_batch_norm_in_float32_the_wrapper_takes_torchs_steps_bit_for_bit(trained):
    """As a user runs it (float32, BatchNorm), with accumulation: 2 processes add the same two gradients in
    either wrapper, so the weights are equal bit for bit. BatchNorm's running statistics are buffers: each
    rank updates its own, and both wrappers hand rank 0's to every rank before the next forward, so that
    every rank evaluates with rank 0's (the same test loss)."""
    scratch, torch_ddp = trained(("scratch", 2, 2, "batch")), trained(("torch", 2, 2, "batch"))
    assert_same_weights(scratch, torch_ddp)
    ours, theirs = read_metrics(scratch.parent), read_metrics(torch_ddp.parent)
    assert METRIC_KEYS <= ours.keys()
    assert (ours["test_loss"], ours["test_accuracy"]) == (theirs["test_loss"], theirs["test_accuracy"])
    assert models.count_parameters(models.load_weights(scratch)) == 1_646_122  # a plain state_dict of ResNet-9
