"""The recipe flags (--width, --label-smoothing, --tta), the per-epoch history in metrics.json, the picture
drawn from it (benchmarks/report.py) and the pipeline benchmark (benchmarks/pipeline.py)."""

import re

import pytest
from jobs import SYNTHETIC_ARGS, run_job
from launch import ROOT, python
from outputs import assert_same_weights, check_ok, read_metrics

from common import data, models

# Two short epochs of a narrow ResNet-9: 10 steps each at this batch size.
RECIPE_ARGS = [*SYNTHETIC_ARGS, "--epochs", "2", "--batch-size", "240", "--width", "8", "--label-smoothing", "0.1"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """01 trained with the recipe's flags, evaluated without and with --tta: {name: output dir}."""
    output_dirs = {}
    for name, extra in (("plain", []), ("tta", ["--tta"])):
        output_dirs[name] = tmp_path_factory.mktemp(name)
        check_ok(run_job(python("01_cifar10_cpu.py", *RECIPE_ARGS, *extra, "--output-dir", output_dirs[name])))
    return output_dirs


@pytest.mark.full
def test_metrics_hold_the_history_of_every_epoch(runs):
    metrics = read_metrics(runs["plain"])
    history = metrics["history"]
    assert [epoch["step"] for epoch in history] == [10, 20]
    assert 0 < history[0]["elapsed_seconds"] < history[1]["elapsed_seconds"] <= metrics["wall_seconds"]
    assert history[-1]["test_accuracy"] == metrics["test_accuracy"] and history[-1]["test_loss"] == metrics["test_loss"]
    assert history[0]["train_loss"] > history[1]["train_loss"]
    # --width 8: a ResNet-9 of that width, whose model.pt loads as such.
    model = models.load_weights(runs["plain"] / "model.pt", width=8)
    assert models.count_parameters(model) < models.count_parameters(models.ResNet9()) / 10


@pytest.mark.full
def test_tta_changes_the_evaluation_only(runs):
    assert_same_weights(runs["plain"] / "model.pt", runs["tta"] / "model.pt")
    plain, tta = read_metrics(runs["plain"]), read_metrics(runs["tta"])
    assert plain["train_loss"] == tta["train_loss"]
    assert plain["test_loss"] != tta["test_loss"]
    assert plain["test_samples"] == tta["test_samples"] == data.SYNTHETIC_TEST_SIZE


@pytest.mark.full
def test_report_draws_both_runs(runs, tmp_path):
    picture = tmp_path / "report.png"
    check_ok(run_job(python(ROOT / "benchmarks" / "report.py", runs["plain"], runs["tta"], "--output", picture)))
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    assert picture.stat().st_size > 20_000  # two panels with bars, curves and text, not an empty canvas


def test_report_refuses_a_directory_without_metrics(tmp_path):
    result = run_job(python(ROOT / "benchmarks" / "report.py", tmp_path, "--output", tmp_path / "report.png"))
    assert result.returncode != 0 and "metrics.json not found" in result.stderr


@pytest.mark.full
def test_pipeline_benchmark_prints_the_four_rates_and_the_flop_count():
    result = check_ok(run_job(python(ROOT / "benchmarks" / "pipeline.py", "--steps", "3", "--warmup", "1",
                                     "--batch-size", "64")))
    rates = {loop: float(rate.replace(",", "")) for loop, rate in
             re.findall(r"^(pipeline alone|one by one|model alone|full step) +([\d,]+) images/s$", result.stdout, re.M)}
    # Four rates, and their ratios. Not what the ratios are: 3 steps of each loop, sharing the 2 cores with another
    # test's job, measure nothing (whole batches came out 14 times slower than one sample at a time once). The
    # figures are the benchmark's, in docs/performance.md, with the command that measured them.
    assert rates.keys() == {"pipeline alone", "one by one", "model alone", "full step"}, result.stdout
    assert all(rate > 0 for rate in rates.values()), result.stdout
    assert re.search(r"^pipeline alone / one by one: [\d.]+; pipeline alone / model alone: [\d.]+", result.stdout, re.M)
    # ResNet-9 at width 32: 570 MFLOP per training image (forward and backward), as torch's counter finds.
    assert "570 MFLOP per training image" in result.stdout
    assert re.search(r"full step at [\d.]+ TFLOP/s = [\d.]+% of", result.stdout), result.stdout
