"""Parity: a distributed run ends with the weights of the single-process run (benchmarks/parity.py)."""

import parity
import pytest
from helpers import check_ok, run

from common import models


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The model.pt of a parity run, trained once for all the tests of this module."""
    paths = {}

    def train(name):
        if name not in paths:
            output_dir = tmp_path_factory.mktemp("parity")
            check_ok(run(parity.command(parity.RUNS_BY_NAME[name], output_dir), timeout=300, env=parity.ENV))
            paths[name] = output_dir / "model.pt"
        return paths[name]

    return train


@pytest.mark.parametrize("name", [run.name for run in parity.RUNS if run.reference])
def test_same_weights_as_the_reference_run(name, trained):
    run_ = parity.RUNS_BY_NAME[name]
    difference = parity.max_relative_difference(trained(name), trained(run_.reference))
    assert difference <= parity.TOLERANCE[run_.dtype], f"{name} vs {run_.reference}: {difference:.1e}"


def test_group_norm_weights_load_into_the_common_model(trained):
    model = models.load_weights(trained("04 x2"), norm="group")
    assert models.count_parameters(model) == 1_646_122
