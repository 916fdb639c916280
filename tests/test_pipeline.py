"""Step 08 as users launch it on the CPU: pipeline stages under torchrun, alone (2 stages) and with
data parallelism (2 stages x 2 replicas), exact evaluation, the whole model in model.pt, checkpoints
written stage by stage that resume exactly. Parity with 01 in float64 is in tests/test_parity.py, a
killed worker in tests/test_faults.py, bad input in tests/test_errors.py."""

import json

import pytest
from jobs import SMALL_RESNET9, SMOKE_ARGS, SYNTHETIC_ARGS, run_job
from launch import forked, python, torchrun
from outputs import check_ok, check_smoke_run, read_metrics
from resume import check_exact_resume, check_only_the_last_checkpoint_kept

SCRIPT = "08_cifar10_pipeline.py"


# Plain python, a world of one with one stage, runs below: the gradients' reference.
@pytest.mark.full
@pytest.mark.parametrize("nproc, args, stages", [
    (2, [], 2),  # the default: as many stages as processes, up to 5 and the 4 micro-batches
    (4, ["--stages", 2, "--schedule", "gpipe"], 2),  # 2 stages x 2 replicas
])
def test_pipeline_step(nproc, args, stages, tmp_path):
    result = check_ok(run_job(torchrun(nproc, SCRIPT, *SMOKE_ARGS, *args, "--output-dir", tmp_path)))
    check_smoke_run(tmp_path, SCRIPT, world_size=nproc)  # model.pt: every stage's part, with ResNet9's keys
    assert (read_metrics(tmp_path)["stages"], read_metrics(tmp_path)["microbatches"]) == (stages, 4)
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    assert f"{stages} stage(s) x {nproc // stages} replica(s)\n" in result.stdout


@pytest.mark.full
def test_one_sample_per_replica_evaluates_a_test_set_that_the_replicas_split_unevenly(tmp_path):
    """2 replicas of 2 stages, 1 sample each per step: the 1,001 test samples split 501 and 500, in as many
    batches on each replica, so that one batch of the first holds 2 samples, more than the training batch. Each
    replica pads every batch to one shape, which its second stage receives (a batch of another shape would not
    fit the buffer that the stage sized from the first), and every sample is counted once."""
    check_ok(run_job(torchrun(4, SCRIPT, *SYNTHETIC_ARGS, *SMALL_RESNET9, "--stages", 2, "--microbatches", 1,
                              "--schedule", "gpipe", "--batch-size", 2, "--max-steps", 2, "--output-dir", tmp_path),
                     timeout=300))
    assert read_metrics(tmp_path)["test_samples"] == 1001


@pytest.mark.full
def test_eight_processes_default_to_4_stages_of_2_replicas(tmp_path):
    """The README's command on a node of 8 GPUs: the stages default to the most that divide the world size within
    ResNet-9's 5 blocks and the 4 micro-batches that 1F1B needs at least as many of. Small and one step: the
    claim is the layout, on 8 processes sharing 2 cores."""
    result = check_ok(run_job(torchrun(8, SCRIPT, *SYNTHETIC_ARGS, *SMALL_RESNET9, "--max-steps", 1,
                                       "--output-dir", tmp_path), timeout=300))
    assert (read_metrics(tmp_path)["stages"], read_metrics(tmp_path)["world_size"]) == (4, 8)
    assert "4 stage(s) x 2 replica(s)\n" in result.stdout


@pytest.mark.full
def test_five_processes_get_no_pipeline_and_say_why(tmp_path):
    """5 processes: no stage count from 2 to 4 (the micro-batches) divides 5, so 08 trains 5 replicas of one
    stage, and its first line says so. Small and one step, as above."""
    result = check_ok(run_job(torchrun(5, SCRIPT, *SYNTHETIC_ARGS, *SMALL_RESNET9, "--batch-size", 40, "--max-steps", 1,
                                       "--output-dir", tmp_path), timeout=300))
    assert (read_metrics(tmp_path)["stages"], read_metrics(tmp_path)["world_size"]) == (1, 5)
    assert "1 stage(s) x 5 replica(s): no stage count from 2 to 4 divides 5 (--help)\n" in result.stdout


@pytest.mark.full
def test_resume_mid_epoch_matches_uninterrupted_run(tmp_path):
    """2 stages x 2 replicas: each stage writes its part of the weights and optimizer state once (the two
    replicas hold it alike), each rank reads back its own; `latest` names the newest complete checkpoint.
    Started again, the finished run stands."""
    stopped, _ = check_exact_resume(lambda *args: forked(4, SCRIPT, *args, *SMALL_RESNET9, "--stages", 2),
                                    tmp_path, again=True)
    check_only_the_last_checkpoint_kept(stopped)


# Two optimizer steps of 2 stages x 4 micro-batches of 2 samples, in float64 with GroupNorm, every action of
# the schedule recorded (tests/collectives.py). The second step is compared: the first also agrees on the
# shapes that the stages exchange.
TRACE_ARGS = ["--synthetic", "--num-workers", 0, "--batch-size", 8, "--epochs", 1, "--max-steps", 2,
              "--norm", "group", "--lr", 0.1]
POINT_TO_POINT = {"send", "recv", "isend", "irecv", "batch_isend_irecv"}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    """traced(name): {stage: the second step's record} of the run `name`: 2 stages under "gpipe" or "1f1b",
    or "one process": one stage and one micro-batch, the whole batch's backward as 01 computes it."""
    records = {}

    def trace(name):
        if name not in records:
            record_dir = tmp_path_factory.mktemp("trace")
            args = ["benchmarks/float64.py", "tests/collectives.py", SCRIPT, *TRACE_ARGS, "--output-dir", record_dir]
            command = (python(*args, "--microbatches", 1) if name == "one process"
                       else torchrun(2, *args, "--schedule", name))
            check_ok(run_job(command, env={"COLLECTIVES_DIR": str(record_dir)}))
            steps = [json.loads(path.read_text()) for path in sorted(record_dir.glob("collectives-rank*.json"))]
            assert all(len(ranks_steps) == 2 for ranks_steps in steps)
            records[name] = {ranks_steps[1]["stage"]: ranks_steps[1] for ranks_steps in steps}
        return records[name]
    return trace


def compute(record):
    return [action for action in record["actions"] if " " not in action]


def in_flight(record):
    """The most micro-batches whose activations the stage held at once: forwarded, not yet backwarded."""
    held = peak = 0
    for action in compute(record):
        held += 1 if action.startswith("F") else -1
        peak = max(peak, held)
    return peak


FORWARDS, BACKWARDS = [f"F{index}" for index in range(4)], [f"B{index}" for index in range(4)]


@pytest.mark.full
def test_gpipe_runs_every_forward_before_any_backward(traced):
    for record in traced("gpipe").values():
        assert compute(record) == FORWARDS + BACKWARDS
        assert in_flight(record) == 4  # every micro-batch's activations at once


@pytest.mark.full
def test_1f1b_alternates_once_the_pipe_is_full(traced):
    """Stage 0 starts one micro-batch ahead (one per later stage), then alternates: it holds 2 micro-batches'
    activations at most, the last stage 1, whatever the number of micro-batches."""
    first, last = traced("1f1b")[0], traced("1f1b")[1]
    assert compute(first) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"]
    assert compute(last) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]
    assert (in_flight(first), in_flight(last)) == (2, 1)


@pytest.mark.full
def test_both_schedules_send_the_same_messages_point_to_point(traced):
    """The same activations forward and gradients back, in another order; no collective of the whole group
    inside the schedule (the replicas' gradient all-reduce comes after it)."""
    for schedule in ("gpipe", "1f1b"):
        first, last = traced(schedule)[0], traced(schedule)[1]
        assert sorted(a for a in first["actions"] if " " in a) == sorted(
            [f"send {f}" for f in FORWARDS] + [f"recv {b}" for b in BACKWARDS])
        assert sorted(a for a in last["actions"] if " " in a) == sorted(
            [f"recv {f}" for f in FORWARDS] + [f"send {b}" for b in BACKWARDS])
        assert set(first["collectives"]) | set(last["collectives"]) <= POINT_TO_POINT


@pytest.mark.full
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_the_pipeline_gradients_are_one_process_gradients(schedule, traced):
    """Each micro-batch's loss is a mean over its 2 samples, and the stages add up the gradients of the 4
    micro-batches: the schedule's scale_grads divides them by 4. Then they are the whole batch's gradients
    as one process computes them (without the division, 4 times as large)."""
    pipeline = traced(schedule)[0]["gradient_norms"] + traced(schedule)[1]["gradient_norms"]
    reference = traced("one process")[0]["gradient_norms"]
    assert len(pipeline) == len(reference)
    assert max(abs(a - b) / b for a, b in zip(pipeline, reference, strict=True)) < 1e-12
