"""Parity: a distributed run ends with the weights of the single-process run (benchmarks/parity.py).

The rows run as benchmarks/parity.py runs them, shortened: a small data set of 3 batches of 8 for 2 epochs,
whose 6 steps cross an epoch boundary (where a sampler that is not told the epoch would repeat the first
epoch's order), instead of 20 steps in one epoch; smaller models (SMALL_MODELS); torchrun's processes
forked (`launch.forked`: what they compute is the claim, not how torchrun starts them). The float32 rows
(05's) run the benchmark's 2 steps, on the same small data set. The quick tier runs each distributed step's row
at 2 processes and its reference; the full tier the rest."""

import dataclasses

import parity
import pytest
from data_dirs import tiny_cifar10, tiny_mnist
from jobs import SMALL_RESNET9, SMALL_VIT, run_job
from outputs import check_ok, read_metrics, trained_once

from common import models

TRAIN_SIZE, TEST_SIZE, EPOCHS = 24, 10, 2
STEPS = TRAIN_SIZE // 8 * EPOCHS  # the float64 rows' steps
# Rows of more than 2 processes, and rows that a 2-process row of the same step already holds.
FULL_TIER = {"03", "04 x4", "05 ZeRO-0 x2", "08 2x2", "09 2x2", "10 x4", "10 2x2", "11 x4", "11 2x2"}
# And smaller models than the benchmark's (06's CNN has no width).
SMALL_MODELS = {**dict.fromkeys(["01", "03", "04", "05", "07", "08"], list(map(str, SMALL_RESNET9))),
                **dict.fromkeys(["09", "10", "11"], list(map(str, SMALL_VIT)))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(name): model.pt of the parity row `name`."""
    data = tmp_path_factory.mktemp("parity")
    data_args = {"06": ["--data-dir", tiny_mnist(data / "mnist", TRAIN_SIZE, TEST_SIZE), "--epochs", EPOCHS],
                 "other": ["--data-dir", tiny_cifar10(data / "cifar10", TRAIN_SIZE, TEST_SIZE), "--epochs", EPOCHS]}

    def command(name, output_dir):
        return row_command(name, output_dir, data_args["06" if name.startswith("06") else "other"])

    return trained_once(tmp_path_factory, command, timeout=300, env=parity.ENV)


def row_command(name, output_dir, data):
    """The command line of the parity row `name`, as the tiers run it, on `data` (the data set and epochs)."""
    row = parity.ROWS_BY_NAME[name]
    if row.launcher == "torchrun":  # 06's `accelerate launch` stays, the tiers' only parity check of it
        row = dataclasses.replace(row, launcher="forked")
    if row.dtype == "float64":  # float32 rows: 2 steps, as the benchmark runs them (rounding sets in soon after)
        row = dataclasses.replace(row, steps=STEPS)
    return [*parity.command(row, output_dir, data=data), *SMALL_MODELS.get(row.script[:2], [])]


@pytest.mark.parametrize("name", [pytest.param(row.name, marks=[pytest.mark.full] if row.name in FULL_TIER else [])
                                  for row in parity.ROWS if row.reference])
def test_same_weights_as_the_reference_run(name, trained):
    row = parity.ROWS_BY_NAME[name]
    difference = parity.max_relative_difference(trained(name), trained(row.reference))
    assert difference <= parity.TOLERANCE[row.dtype], f"{name} vs {row.reference}: {difference:.1e}"


@pytest.mark.full
def test_test_time_augmentation_of_08_evaluates_as_01s(tmp_path):
    """--tta on 2 stages: 08's last stage averages the logits of the images and of their mirror images, as
    models.predict does in 01. The same weights (the rows above), so the same test loss, to the rows' tolerance.
    7 test samples, one batch in both (08 pads it to the training batch of 8): the evaluation sums each batch's
    losses in float32 (`logits.float()`), so 01's batches of 8 and 08's equal batches would round apart."""
    data = ["--data-dir", tiny_cifar10(tmp_path / "cifar10", TRAIN_SIZE, 7), "--epochs", EPOCHS, "--tta"]
    metrics = {}
    for name in ("01", "08 2x1"):
        output_dir = tmp_path / name.replace(" ", "_")
        check_ok(run_job(row_command(name, output_dir, data), timeout=300, env=parity.ENV))
        metrics[name] = read_metrics(output_dir)
    assert metrics["08 2x1"]["test_samples"] == metrics["01"]["test_samples"] == 7
    assert metrics["08 2x1"]["test_loss"] == pytest.approx(metrics["01"]["test_loss"], rel=parity.TOLERANCE["float64"])
    assert metrics["08 2x1"]["test_accuracy"] == metrics["01"]["test_accuracy"]


def test_group_norm_weights_load_into_the_common_model(trained):
    model = models.load_weights(trained("04 x2"), norm="group", width=8)
    assert models.count_parameters(model) == 103_954
