"""Step 05 as users launch it on the CPU: torchrun, the deepspeed launcher and plain python, ZeRO stages
0-3, exact evaluation, fp32 model.pt, the same optimizer steps as DDP, gradient accumulation and what
each stage communicates per micro-batch, exact resume, one-line errors.

DeepSpeed compiles its CPU communication op at its first run on a machine (about 45 s on 2 cores, then
cached in ~/.cache/torch_extensions): install.sh does it; a run here that finds it missing (another ninja
built it: docs/deepspeed.md) compiles it again within its own timeout.
"""

import datetime
import json
import os
import shutil
import sys

import parity
import pytest
import torch
from data_dirs import tiny_cifar10
from jobs import SHORT_RUN_ARGS, SMALL_RESNET9, SMOKE_ARGS, SYNTHETIC_ARGS, import_script, run_job, sized_for
from launch import LAUNCHERS, ON_GPU, environment, forked, in_local_processes, torchrun
from outputs import (
    assert_same_weights,
    check_ok,
    check_one_error,
    check_smoke_run,
    load_state,
    read_metrics,
    resumed_steps,
)
from resume import END_STEP, check_another_norm_is_refused, check_exact_resume

from common import utils

SCRIPT = "05_cifar10_deepspeed.py"


def launch(launcher, nproc, *args, timeout=180):
    # torchrun gives each worker one thread; the deepspeed launcher leaves that to us (2 processes with
    # all the cores each run several times slower than with one each).
    env = {"OMP_NUM_THREADS": "1"} if launcher == "deepspeed" else None
    return run_job(LAUNCHERS[launcher](nproc, SCRIPT, *args), timeout=timeout, env=env)


@pytest.mark.full
@pytest.mark.parametrize("launcher, nproc, zero_stage, amp", [
    ("torchrun", 2, None, "none"),  # the config file's stage (2)
    ("torchrun", 3, 3, "bf16"),
    ("deepspeed", 2, 0, "none"),
    ("deepspeed", 3, 1, "none"),
    ("python", 1, None, "none"),  # no launcher: a world of one
])
def test_deepspeed_step(launcher, nproc, zero_stage, amp, request, tmp_path):
    stage_args = [] if zero_stage is None else ["--zero-stage", zero_stage]
    size, timeout, width = sized_for(amp)
    result = check_ok(launch(launcher, nproc, *SMOKE_ARGS, *size, *stage_args, "--amp", amp, "--output-dir", tmp_path,
                             timeout=timeout))
    metrics = check_smoke_run(tmp_path, SCRIPT, world_size=nproc, amp=amp, width=width)
    assert metrics["zero_stage"] == (2 if zero_stage is None else zero_stage)
    assert result.stdout.count("epoch 1/1") == 1  # rank 0 alone prints
    if nproc == 2 and not ON_GPU:
        # The engine takes exactly DDP's steps: same batches, same averaged gradients, same SGD.
        assert_same_weights(tmp_path / "model.pt", request.getfixturevalue("ddp_weights"))


@pytest.mark.full
@pytest.mark.parametrize("zero_stage", [0, 3])
def test_amp_keeps_the_weights_and_batchnorm_statistics_in_fp32(zero_stage, tmp_path):
    """--amp bf16 is torch.autocast inside the engine (the config's torch_autocast), not DeepSpeed's bf16
    mode, which casts the parameters: after a few steps, model.pt's weights and BatchNorm statistics are
    fp32 numbers that bf16 cannot hold (the module's own state with ZeRO-0, zero_to_fp32's with ZeRO-3)."""
    data_dir = tiny_cifar10(tmp_path / "data", 96, 10)
    check_ok(launch("torchrun", 2, "--data-dir", data_dir, *SHORT_RUN_ARGS, "--max-steps", 3, "--zero-stage",
                    zero_stage, "--amp", "bf16", *SMALL_RESNET9, "--output-dir", tmp_path / "out"))
    state = load_state(tmp_path / "out" / "model.pt")
    floats = {name: tensor for name, tensor in state.items() if tensor.is_floating_point()}
    assert any("running_var" in name for name in floats)
    assert {tensor.dtype for tensor in floats.values()} == {torch.float32}
    rounded = [name for name, tensor in floats.items() if torch.equal(tensor, tensor.bfloat16().float())]
    assert not rounded, f"bf16 roundings in model.pt: {rounded}"


# Half ResNet-9's width: ZeRO-3 keeps a parameter of at most 1e5 elements whole on every rank
# (stage3_param_persistence_threshold); at width 16 two of 147,456 are partitioned and gathered in each pass.
ZERO3_PARTITIONED = ["--width", 16]


def test_resume_with_zero3_matches_uninterrupted_run(tmp_path):
    """Stopped and resumed (both mid-epoch) equals one go: every rank saves and reloads its own shard of
    the weights and the optimizer state, and `latest` names the newest complete checkpoint. With 2
    micro-batches per step, the resumed run skips twice as many micro-batches as steps. Started again, the
    finished run stands; with GroupNorm instead of its BatchNorm, it stops in one line, before DeepSpeed's strict
    load of the weights."""
    zero3 = [*ZERO3_PARTITIONED, "--zero-stage", 3, "--gradient_accumulation_steps", 2]
    def launch(*args):
        return forked(2, SCRIPT, *args, *zero3)
    stopped, args = check_exact_resume(launch, tmp_path, again=True)
    assert read_metrics(stopped)["zero_stage"] == 3  # the engine's own stage: --zero-stage overrides the config's 2
    checkpoints = stopped / "checkpoints"
    assert (checkpoints / "latest").read_text() == f"step{END_STEP}"
    assert [path.name for path in checkpoints.iterdir() if path.is_dir()] == [f"step{END_STEP}"]  # older ones removed
    check_another_norm_is_refused(launch, args, stopped)


def fp16_scales_saved_and_resumed(output_dir, zero_stage):
    """A small model in a DeepSpeed engine under `torch_autocast` fp16 (ZeRO `zero_stage`, on the CPU): after one
    finite step its loss scale is set to 1024 and 05's save_checkpoint saves it; a new engine, through 05's
    load_checkpoint, continues. Returns the two engines' scaler states (scale, growth tracker...)."""
    # As a launcher would (this forked process only), with the environment's ninja, which built DeepSpeed's op.
    # DeepSpeed's CPU accelerator on a GPU machine too (set again below, in case this process inherited another):
    # the model and its input stay on the CPU.
    os.environ.update(environment({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}))
    import deepspeed
    from deepspeed.accelerator import set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    set_accelerator(CPU_Accelerator())
    step = import_script(SCRIPT)
    sys.argv = [SCRIPT, "--synthetic", "--output-dir", str(output_dir)]
    context = utils.Context(step.parse_args(), torch.device("cpu"))
    config = {"train_batch_size": 2, "zero_allow_untested_optimizer": True, "zero_optimization": {"stage": zero_stage},
              "torch_autocast": {"enabled": True, "dtype": "fp16"}}
    scales = []
    for saving in (True, False):
        model = torch.nn.Linear(4, 2)
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config)
        state = utils.State(engine, optimizer, None, 1, utils.deepspeed_grad_scaler(engine))
        if saving:
            # A finite step (the scaler's first use makes its scale and counts it), then a scale of 1024.
            engine.backward(engine(torch.ones(2, 4)).float().sum() * 1e-3)
            engine.step()
            state.scaler.update(1024.0)
            state.step = 1
            step.save_checkpoint(context, state)
        else:
            step.load_checkpoint(context, state)
        scales.append(state.scaler.state_dict())
    return scales


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_an_fp16_resume_continues_with_the_saved_loss_scale(zero_stage, tmp_path):
    """DeepSpeed 0.19.8 checkpoints leave out the torch GradScaler it scales fp16 losses with under `torch_autocast`
    (the engine's under ZeRO-0, the ZeRO optimizer's under 1 to 3): 05 keeps it in the client state. Without it a
    resumed fp16 run starts again from the initial scale, 65536, and skips other steps than the run that never
    stopped. 05 runs fp16 on GPUs only; the engine and its scaler are the same on the CPU."""
    scales = in_local_processes(lambda rank: fp16_scales_saved_and_resumed(tmp_path, zero_stage), 1,
                                datetime.timedelta(seconds=300))  # a missing op is compiled: 45 s and more
    saved, resumed = scales[0]
    assert (saved["scale"], saved["_growth_tracker"]) == (1024.0, 1) and resumed == saved


@pytest.mark.full
def test_zero3_checkpoint_refuses_another_world_size(tmp_path):
    """ZeRO-3's shards fit 2 processes only: DeepSpeed's universal checkpoint, which would re-partition them,
    converts Adam's state only. 3 processes are refused, in one line; so is another ZeRO stage, whose files
    DeepSpeed would look for in vain."""
    same = ["--data-dir", tiny_cifar10(tmp_path / "data", 96, 11), *SHORT_RUN_ARGS, "--epochs", 2, *SMALL_RESNET9,
            "--output-dir", tmp_path / "out"]
    check_ok(launch("torchrun", 2, *same, "--zero-stage", 3, "--max-steps", 4, "--save-every", 4))
    result = run_job(torchrun(3, SCRIPT, *same, "--zero-stage", 3, "--max-steps", 8, "--resume"), timeout=120)
    check_one_error(result, "with 3 processes: its ZeRO shards were written by 2", "not SGD's")
    result = run_job(torchrun(2, SCRIPT, *same, "--zero-stage", 2, "--max-steps", 8, "--resume"), timeout=120)
    check_one_error(result, "was written with zero_stage=3, this run has 2; resume with the same --zero-stage")


@pytest.mark.full
def test_zero0_checkpoint_resumes_at_another_world_size(tmp_path):
    """Without ZeRO every rank's checkpoint holds the whole state, so 3 processes resume 2 processes' checkpoint:
    exactly the saved weights (a resume that trains no step writes them back), and on from there. Not compared
    with an uninterrupted 3-process run: float32 sums in another order, which training amplifies."""
    args = ["--data-dir", tiny_cifar10(tmp_path / "data", 96, 11), *SHORT_RUN_ARGS, "--epochs", 2, "--zero-stage", 0,
            *SMALL_RESNET9]
    saved, loaded, continued = tmp_path / "saved", tmp_path / "loaded", tmp_path / "continued"
    check_ok(launch("torchrun", 2, *args, "--max-steps", 4, "--save-every", 4, "--output-dir", saved))
    for output_dir, steps in ((loaded, 4), (continued, 8)):
        shutil.copytree(saved / "checkpoints", output_dir / "checkpoints")
        result = check_ok(launch("torchrun", 3, *args, "--max-steps", steps, "--resume", "--output-dir", output_dir))
        assert resumed_steps(result.stdout) == [4], result.stdout[-2000:]
        assert (read_metrics(output_dir)["world_size"], read_metrics(output_dir)["steps"]) == (3, steps)
    assert_same_weights(saved / "model.pt", loaded / "model.pt")


@pytest.mark.full
@pytest.mark.parametrize("launcher, nproc, args, message", [
    ("deepspeed", 3, ["--batch-size", 32], "--batch-size 32 is not divisible by the world size 3"),
    ("python", 1, ["--resume"], "--resume: no checkpoint in"),
])  # --amp fp16 on a CPU: tests/test_errors.py (the table's row)
def test_bad_input_is_one_line(launcher, nproc, args, message, tmp_path):
    result = launch(launcher, nproc, *SYNTHETIC_ARGS, *args, "--output-dir", tmp_path, timeout=120)
    check_one_error(result, message)
    assert not (tmp_path / "metrics.json").exists()


# The gradient reductions that DeepSpeed 0.19.8 runs in the backward pass of each micro-batch, per ZeRO
# stage: (in the first N-1 micro-batches of an optimizer step, in the Nth). Stages 0 and 1 add the
# micro-batches' gradients up locally and reduce the sum once; stage 2 reduces in every backward pass
# (an all-reduce of its gradient bucket) and adds the result to its partition; stage 3 reduce-scatters
# in every one.
BACKWARD_REDUCTIONS = {0: ([], ["all_reduce"]), 1: ([], ["all_reduce"]), 2: (["all_reduce"], ["all_reduce"]),
                       3: (["reduce_scatter_tensor"], ["reduce_scatter_tensor"])}
REDUCTIONS = {"all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
              "_reduce_scatter_base"}
ACCUMULATION, ACCUMULATION_STEPS = 4, 3
# ZeRO-1 and 2 reduce float64 gradients (0 and 3 refuse them) but keep fp32 master weights: float64
# rounding differences in the gradients become fp32 rounding differences in the weights (measured: 1e-7
# to 2e-7 after 2 to 10 steps). In plain fp32, another summation order shows as 3e-4 after 2 steps; a
# wrong loss scale or schedule as much more.
ACCUMULATION_TOLERANCE = 1e-6


def accumulation_args(data_dir, zero_stage):
    """2 processes, --batch-size 24, a few steps; float64 where DeepSpeed reduces it, and --norm group,
    whose result does not depend on how the batch is split (docs/parity.md)."""
    in_float64 = ["benchmarks/float64.py"] if zero_stage in (1, 2) else []
    return [*in_float64, SCRIPT, "--data-dir", data_dir, "--num-workers", 0, "--batch-size", 24, "--lr", 0.1,
            "--epochs", 1, "--max-steps", ACCUMULATION_STEPS, "--norm", "group", "--zero-stage", zero_stage]


@pytest.fixture(scope="module")
def accumulation_data(tmp_path_factory):
    return tiny_cifar10(tmp_path_factory.mktemp("accumulation") / "data", train_size=240, test_size=4)


@pytest.fixture(scope="module")
def without_accumulation(tmp_path_factory, accumulation_data):
    """model.pt of one micro-batch of 12 per process and step (ZeRO-2, the config's; ZeRO-1 ends with the
    same weights, bit for bit)."""
    output_dir = tmp_path_factory.mktemp("without_accumulation")
    check_ok(run_job(forked(2, *accumulation_args(accumulation_data, 2), "--output-dir", output_dir)))
    return output_dir / "model.pt"


@pytest.mark.full
@pytest.mark.parametrize("zero_stage", BACKWARD_REDUCTIONS)
def test_gradient_accumulation(zero_stage, accumulation_data, request, tmp_path):
    """--gradient_accumulation_steps 4: each optimizer step is 4 micro-batches of 3 samples on each of
    the 2 processes, and (ZeRO-1 and 2, in float64) ends with the weights of one micro-batch of 12. Every
    collective is recorded (tests/collectives.py): each micro-batch communicates as its stage does."""
    output_dir = tmp_path / "out"
    check_ok(run_job(forked(2, "tests/collectives.py", *accumulation_args(accumulation_data, zero_stage),
                              "--gradient_accumulation_steps", ACCUMULATION, "--output-dir", output_dir),
                     env={"COLLECTIVES_DIR": str(tmp_path)}))
    metrics = read_metrics(output_dir)
    assert (metrics["global_batch_size"], metrics["steps"]) == (24, ACCUMULATION_STEPS)
    first, last = BACKWARD_REDUCTIONS[zero_stage]
    for rank in (0, 1):
        micro_batches = json.loads((tmp_path / f"collectives-rank{rank}.json").read_text())
        for index, micro_batch in enumerate(micro_batches):
            nth = (index + 1) % ACCUMULATION == 0
            reductions = [name for name in micro_batch["backward"] if name in REDUCTIONS]
            assert reductions == (last if nth else first), f"rank {rank}, micro-batch {index + 1}: {micro_batch}"
            if zero_stage < 2 and not nth:  # no communication at all before the Nth
                assert micro_batch == {"boundary": False, "forward": [], "backward": [], "step": []}
        # The engine's boundaries: an optimizer step every Nth micro-batch.
        assert [m["boundary"] for m in micro_batches] == ([False] * (ACCUMULATION - 1) + [True]) * ACCUMULATION_STEPS
    if zero_stage in (1, 2):
        difference = parity.max_relative_difference(output_dir / "model.pt",
                                                    request.getfixturevalue("without_accumulation"))
        assert difference <= ACCUMULATION_TOLERANCE, f"{difference:.1e}"
