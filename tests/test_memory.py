"""What sharding saves (benchmarks/memory.py), measured once with 2 processes and checked against the sizes of
ResNet-9's fp32 tensors: DDP cuts nothing; ZeRO-1 and 2 cut the optimizer state by the number of processes;
ZeRO-2 also the gradients; ZeRO-3 and FSDP2 the parameters too. Where a partition is padded (DeepSpeed aligns
its flat buffers), by a few bytes at most. Also: the records that --json writes, the table, the picture,
DeepSpeed's reduce bucket, which the benchmark reports instead of hiding, and what 07's ranks hold while they build
the model on the meta device."""

import json

import pytest
import torch
from jobs import run_job
from launch import ON_GPU, ROOT, python
from outputs import check_ok

from common import models

pytestmark = pytest.mark.full  # the full tier: the benchmark's runs (docs/testing.md)

WORLD_SIZE = 2
METHODS = ["DDP", "ZeRO-1", "ZeRO-2", "ZeRO-3", "FSDP2"]
# One fp32 copy of every ResNet-9 weight: the parameters, the gradients, the momentum of a whole replica.
FULL = 4 * sum(parameter.numel() for parameter in models.ResNet9().parameters())
SHARD = FULL // WORLD_SIZE  # ResNet-9's tensors all split evenly in 2
PADDING = 64  # bytes: DeepSpeed pads its flat partitions to a few elements' alignment
REQUIRED_KEYS = {"step", "zero_stage", "world_size", "rank", "parameter_bytes", "gradient_bytes", "optimizer_bytes",
                 "peak_bytes", "build_peak_bytes"}
REDUCE_BUCKET = 4 * 500_000_000  # DeepSpeed's default reduce_bucket_size, 5e8 elements, in fp32


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """(printed output, {method: [rank 0's record, rank 1's]}, the picture) of one run of the benchmark."""
    if ON_GPU and torch.cuda.device_count() < WORLD_SIZE:
        pytest.skip(f"{WORLD_SIZE} processes need as many GPUs")
    directory = tmp_path_factory.mktemp("memory")
    records, picture = directory / "memory.json", directory / "memory.png"
    # DeepSpeed's three launches take twice as long as the others (its op, its engine).
    result = check_ok(run_job(python(ROOT / "benchmarks" / "memory.py", "--methods", *METHODS, "--world-sizes",
                                     WORLD_SIZE, "--json", records, "--output", picture), timeout=480))
    by_method = {}
    for record in json.loads(records.read_text()):
        by_method.setdefault(record["method"], []).append(record)
    return result.stdout, by_method, picture


def momentum(record):
    """The optimizer's state without DeepSpeed's fp32 master weights: SGD's momentum buffers."""
    return record["optimizer_bytes"] - record["master_weight_bytes"]


def near(value, expected):
    """`expected`, or a little more: a padded partition."""
    return expected <= value <= expected + PADDING


def test_one_record_per_rank_with_the_required_keys(measured):
    _, by_method, _ = measured
    assert list(by_method) == METHODS
    for method, records in by_method.items():
        assert [record["rank"] for record in records] == list(range(WORLD_SIZE))
        for record in records:
            assert REQUIRED_KEYS <= record.keys()
            assert record["world_size"] == WORLD_SIZE
            assert record["step"] == {"DDP": "04", "FSDP2": "07"}.get(method, "05")
            assert record["zero_stage"] == (int(method[-1]) if method.startswith("ZeRO") else None)
            assert record["peak_bytes"] > 0  # measured on a CPU too


def test_the_table_and_the_picture(measured):
    stdout, by_method, picture = measured
    lines = stdout.splitlines()
    assert f"torch {torch.__version__}" in lines[0]
    rows = [line.split() for line in lines if len(line.split()) == 12 and line.split()[0] in METHODS]
    assert len(rows) == len(METHODS) * WORLD_SIZE
    assert f"{by_method['DDP'][0]['parameter_bytes'] / 1e6:.2f}" in rows[0]
    assert picture.read_bytes().startswith(b"\x89PNG")


def test_fsdp_builds_no_whole_model_on_a_rank_but_0(measured):
    """07 builds on the meta device: rank 1 allocates its shards and receives rank 0's initial weights one whole
    tensor at a time (plus BatchNorm's statistics and a few scalars, under 32 KB); DDP's rank 1 builds all of it."""
    _, by_method, _ = measured
    largest = 4 * max(parameter.numel() for parameter in models.ResNet9().parameters())
    assert by_method["DDP"][1]["build_peak_bytes"] >= FULL
    assert SHARD + largest <= by_method["FSDP2"][1]["build_peak_bytes"] <= SHARD + largest + 32_000 < FULL


def test_ddp_cuts_nothing(measured):
    _, by_method, _ = measured
    for record in by_method["DDP"]:
        assert (record["parameter_bytes"], record["gradient_bytes"], record["optimizer_bytes"]) == (FULL,) * 3
        assert record["master_weight_bytes"] == 0
        assert record["buffer_bytes"] == FULL  # DDP's gradient buckets: a second copy of the gradients


@pytest.mark.parametrize("method", ["ZeRO-1", "ZeRO-2"])
def test_zero_1_and_2_cut_the_optimizer_state(measured, method):
    """Each rank keeps the momentum and an fp32 copy of its half of the weights, and the whole model."""
    _, by_method, _ = measured
    for record in by_method[method]:
        assert near(momentum(record), SHARD)
        assert near(record["master_weight_bytes"], SHARD)
        assert near(record["parameter_bytes"], FULL)


def test_zero_2_also_cuts_the_gradients(measured):
    _, by_method, _ = measured
    for record in by_method["ZeRO-2"]:
        assert near(record["gradient_bytes"], SHARD)


@pytest.mark.parametrize("method", ["ZeRO-3", "FSDP2"])
def test_zero_3_and_fsdp2_also_cut_the_parameters(measured, method):
    _, by_method, _ = measured
    for record in by_method[method]:
        assert near(record["parameter_bytes"], SHARD)
        assert near(record["gradient_bytes"], SHARD)
        assert near(momentum(record), SHARD)
    if method == "FSDP2":  # no padding where every tensor splits evenly, and no second copy
        assert [(record["parameter_bytes"], record["gradient_bytes"], record["optimizer_bytes"])
                for record in by_method[method]] == [(SHARD,) * 3] * WORLD_SIZE


@pytest.mark.parametrize("method", METHODS)
def test_the_counts_are_the_zero_papers_formula_except_zero_1(measured, method):
    """(4 + 4 + K)·Ψ, (4 + (4 + K)/N)·Ψ for ZeRO-2, (4 + 4 + K)·Ψ/N for ZeRO-3 and FSDP2, with K = 4 for SGD's
    momentum and 8 with DeepSpeed's master weights. ZeRO-1 holds less at the step than (4 + 4 + K/N)·Ψ:
    DeepSpeed has reduced the gradients to its partition by then (docs/memory.md)."""
    _, by_method, _ = measured
    for record in by_method[method]:
        counted = record["parameter_bytes"] + record["gradient_bytes"] + record["optimizer_bytes"]
        if method == "ZeRO-1":
            assert near(counted, record["formula_bytes"] - SHARD)
        else:
            assert near(counted, record["formula_bytes"])


def test_deepspeed_reports_its_reduce_bucket(measured):
    """ZeRO-3 keeps a reduce bucket of 5e8 elements for good; ZeRO-1 and 2 allocate theirs in each backward
    pass and free it before the step: it shows in their peak."""
    _, by_method, _ = measured
    for record in by_method["ZeRO-3"]:
        assert record["buffers"]["engine.optimizer.ipg_buckets.buffer"] == REDUCE_BUCKET
    for method in ("ZeRO-1", "ZeRO-2"):
        for record in by_method[method]:
            assert record["buffer_bytes"] < PADDING
            assert record["peak_bytes"] > REDUCE_BUCKET
