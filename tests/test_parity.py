"""Parity: a distributed run ends with the weights of the single-process run (benchmarks/parity.py)."""

import parity
import pytest
from outputs import trained_once

from common import models


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(name): model.pt of the parity row `name`."""
    return trained_once(tmp_path_factory, lambda name, out: parity.command(parity.ROWS_BY_NAME[name], out),
                        timeout=300, env=parity.ENV)


@pytest.mark.parametrize("name", [row.name for row in parity.ROWS if row.reference])
def test_same_weights_as_the_reference_run(name, trained):
    row = parity.ROWS_BY_NAME[name]
    difference = parity.max_relative_difference(trained(name), trained(row.reference))
    assert difference <= parity.TOLERANCE[row.dtype], f"{name} vs {row.reference}: {difference:.1e}"


def test_group_norm_weights_load_into_the_common_model(trained):
    model = models.load_weights(trained("04 x2"), norm="group")
    assert models.count_parameters(model) == 1_646_122
