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
from jobs import SMALL_RESNET9, SMALL_VIT
from outputs import trained_once

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
        row = parity.ROWS_BY_NAME[name]
        if row.launcher == "torchrun":  # 06's `accelerate launch` stays, the tiers' only parity check of it
            row = dataclasses.replace(row, launcher="forked")
        if row.dtype == "float64":  # float32 rows: 2 steps, as the benchmark runs them (rounding sets in soon after)
            row = dataclasses.replace(row, steps=STEPS)
        return [*parity.command(row, output_dir, data=data_args["06" if row.script.startswith("06") else "other"]),
                *SMALL_MODELS.get(row.script[:2], [])]

    return trained_once(tmp_path_factory, command, timeout=300, env=parity.ENV)


@pytest.mark.parametrize("name", [pytest.param(row.name, marks=[pytest.mark.full] if row.name in FULL_TIER else [])
                                  for row in parity.ROWS if row.reference])
def test_same_weights_as_the_reference_run(name, trained):
    row = parity.ROWS_BY_NAME[name]
    difference = parity.max_relative_difference(trained(name), trained(row.reference))
    assert difference <= parity.TOLERANCE[row.dtype], f"{name} vs {row.reference}: {difference:.1e}"


def test_group_norm_weights_load_into_the_common_model(trained):
    model = models.load_weights(trained("04 x2"), norm="group", width=8)
    assert models.count_parameters(model) == 103_954
