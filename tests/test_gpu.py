"""The GPU tier: what a GPU machine can check and a CPU cannot. `pytest -m gpu` runs it; without a GPU every
test here is skipped, with the reason.

- Every step trains with --amp bf16 and fp16 and its loop waits for the GPU, step after step, only where it
  reads the loss (every 10 steps, and before a checkpoint) or where a library must (the fp16 scalers'
  overflow check). A wait once per run or per epoch (a first copy, an evaluation) is not the loop's.
- The batched pipeline gives on CUDA the batches it gives on the CPU (to the last bit before the division
  by 255, which CUDA computes as a multiplication by its reciprocal).
- --resume is exact on a GPU, fp16's loss scale included; with 2 or more GPUs the multi-process steps run
  over NCCL.
"""

import inspect
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from data_dirs import tiny_cifar10, tiny_mnist
from jobs import MNIST_LR, SMOKE_ARGS, SMOKE_STEPS, VIT_LR, run_job
from launch import ON_GPU, SCRIPTS, python, torchrun
from outputs import MIXTURE_OF_EXPERTS, check_ok, check_smoke_run
from resume import check_exact_resume
from torch.utils.data import DistributedSampler

from common import data, models

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_GPU, reason="needs a GPU (CUDA): run `pytest -m gpu` on a GPU machine")]

SYNC_DEBUG = "tests/sync_debug.py"
STEPS = {
    "02": lambda *args: python(SYNC_DEBUG, "02_cifar10_gpu.py", *args),
    "03": lambda *args: python(SYNC_DEBUG, "03_cifar10_dataparallel.py", *args),
    "04": lambda *args: python(SYNC_DEBUG, "04_cifar10_ddp.py", *args),
    "05": lambda *args: python(SYNC_DEBUG, "05_cifar10_deepspeed.py", *args),
    "06": lambda *args: python(SYNC_DEBUG, "06_mnist_accelerate.py", *args, *MNIST_LR),
    "07": lambda *args: python(SYNC_DEBUG, "07_cifar10_fsdp.py", *args),
    "08": lambda *args: python(SYNC_DEBUG, "08_cifar10_pipeline.py", *args),
    "09": lambda *args: python(SYNC_DEBUG, "09_cifar10_tensor_parallel.py", *args, *VIT_LR),
    "10": lambda *args: python(SYNC_DEBUG, "10_cifar10_context_parallel.py", *args, *VIT_LR),
    "11": lambda *args: python(SYNC_DEBUG, "11_cifar10_expert_parallel.py", *args, *VIT_LR),
}
# 08-11 train in bf16 only: 08, 09 and 11 refuse fp16, whose skipped steps every stage, tensor-parallel or
# expert-parallel rank would have to skip together; 10 refuses it to stay 09 and its lesson.
BF16_ONLY = {"08", "09", "10", "11"}
# The steps' own learning rates and models, where they differ from the ResNet-9 steps' (tests/jobs.py).
LEARNING_RATES = {"06": MNIST_LR, "09": VIT_LR, "10": VIT_LR, "11": VIT_LR}
MODEL_CLASSES = {"06": models.MnistCNN, "09": models.VisionTransformer, "10": models.VisionTransformer,
                 "11": MIXTURE_OF_EXPERTS}
# 10 gathers its tokens with funcol.all_gather_single, which PyTorch 2.11 lacks (measured on a GPU machine).
ALL_GATHER_SINGLE = torch.__version__ >= "2.14"


def case(step, *more):
    """`step`'s parameter (and `more`), skipped where this PyTorch cannot run the step."""
    return pytest.param(step, *more, marks=pytest.mark.skipif(step == "10" and not ALL_GATHER_SINGLE, reason=(
        "PyTorch < 2.14 has no funcol.all_gather_single, which 10 calls")))


AMP_CASES = [case(step, amp) for step in STEPS for amp in ("bf16", "fp16") if amp == "bf16" or step not in BF16_ONLY]
# Where a library itself waits for the GPU once per step, by design: the fp16 scalers read their overflow
# flag on the CPU to decide whether to step (torch's GradScaler, DeepSpeed's loss scaler).
LIBRARY_CHECKS = re.compile(r"torch/amp/grad_scaler\.py|deepspeed/runtime/")
# torch's warnings for a kernel without a deterministic implementation, the second for attention's fused backward
# passes (09-11 run strict deterministic mode, where they are deterministic: common/utils.py), the third for cuBLAS
# under another CUBLAS_WORKSPACE_CONFIG.
NONDETERMINISTIC = re.compile(r".*(?:does not have a deterministic implementation|defaults to a non-deterministic "
                              r"algorithm|Deterministic behavior was enabled).*")


def loop_synchronisations(stderr, steps=SMOKE_STEPS):
    """The places in the training loop or the input pipeline that sync_debug.py reported in more than half
    of the steps (a wait at every step), less the loop's own reads of the loss and the libraries' per-step
    checks."""
    counts = Counter()
    for line in stderr.splitlines():
        match = re.match(r"sync: (\S+):(\d+) (\S+) \| (\S+)", line)
        if match and (match[3] == "train_one_epoch" or match[1].endswith("common/data.py")):
            counts[match.groups()] += 1
    found = []
    for (path, number, _, innermost), count in counts.items():
        source = Path(path).read_text().splitlines()[int(number) - 1]
        if count > steps // 2 and ".item()" not in source and not LIBRARY_CHECKS.search(innermost):
            found.append(f"{path}:{number}: {source.strip()} ({count} times, in {innermost})")
    return found


def expert_synchronisations(stderr):
    """The source lines where step 11's expert parallelism or its mixture of experts made the CPU wait."""
    experts = inspect.getsourcelines(models.Experts)[1], inspect.getsourcelines(models.MixtureOfExperts)
    mixture_lines = range(min(experts[0], experts[1][1]), experts[1][1] + len(experts[1][0]))
    found = set()
    for path, number, function in re.findall(r"^sync: (\S+):(\d+) (\w+) \|", stderr, re.M):
        if function == "send_to_experts" or path.endswith("common/models.py") and int(number) in mixture_lines:
            found.add(Path(path).read_text().splitlines()[int(number) - 1].strip())
    return found


@pytest.mark.parametrize(("step", "amp"), AMP_CASES)
def test_the_loop_does_not_wait_for_the_gpu(step, amp, tmp_path):
    result = check_ok(run_job(STEPS[step](*SMOKE_ARGS, "--amp", amp, "--output-dir", tmp_path), timeout=300))
    assert "sync: " in result.stderr, "sync_debug.py reported nothing: is the debug mode on?"
    assert not loop_synchronisations(result.stderr), "\n".join(loop_synchronisations(result.stderr))
    if step == "11":  # one wait per block, by design: the all-to-alls' sizes, both tables copied at once
        [line] = expert_synchronisations(result.stderr)
        assert ".cpu()" in line, line
    # torch warns (use_deterministic_kernels' warn_only) at a kernel that would make --resume drift.
    assert not NONDETERMINISTIC.findall(result.stderr), NONDETERMINISTIC.findall(result.stderr)


def test_the_pipeline_gives_the_same_batches_on_cuda(tmp_path):
    train_set, _ = data.load_cifar10(None, synthetic=True, seed=0)
    train_set.set_epoch(2)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=0)
    on_cpu = list(data.BatchLoader(train_set, 64, sampler=sampler, num_workers=2))
    on_gpu = list(data.BatchLoader(train_set, 64, sampler=sampler, device="cuda", num_workers=2))
    assert len(on_cpu) == len(on_gpu)
    for (cpu_images, cpu_labels), (gpu_images, gpu_labels) in zip(on_cpu, on_gpu, strict=True):
        assert gpu_images.is_cuda and torch.allclose(gpu_images.cpu(), cpu_images, rtol=0, atol=1e-5)
        assert torch.equal(gpu_labels.cpu(), cpu_labels)


@pytest.mark.parametrize("amp", ["none", "bf16", "fp16"])
def test_resume_on_a_gpu_is_exact(amp, tmp_path):
    """Deterministic kernels make two runs of one seed equal on a GPU; the checkpoint carries the fp16 loss
    scale, which a resumed run must continue from."""
    check_exact_resume(lambda *args: python("02_cifar10_gpu.py", *args, "--amp", amp), tmp_path)


# PyTorch before 2.14 infers a pipeline stage's shapes with a real forward pass that advances BatchNorm's
# statistics once per launch (measured with 2.11, whose resumed 08 ends with the same weights and other
# statistics); 2.14 restores the buffers after it.
PIPELINE_INFERENCE_KEEPS_BUFFERS = torch.__version__ >= "2.14"


@pytest.mark.parametrize("step", ["05", "06", "07", pytest.param("08", marks=pytest.mark.skipif(
    not PIPELINE_INFERENCE_KEEPS_BUFFERS, reason="PyTorch < 2.14: the stage's shape inference moves BatchNorm's "
    "statistics")), "09", case("10"), "11"])
def test_resume_of_the_multi_process_steps_on_a_gpu_is_exact(step, tmp_path):
    """In a world of one, bf16: DeepSpeed's engine (05), Accelerate's saved state (06), DCP checkpoints (07,
    09-11), the pipeline's schedule (08) and the transformer's attention kernels (09-11), over NCCL where the
    step starts a process group."""
    script, data_maker = SCRIPTS[step], tiny_mnist if step == "06" else tiny_cifar10
    lr = LEARNING_RATES.get(step, [])
    check_exact_resume(lambda *args: python(script, *args, *lr, "--amp", "bf16"), tmp_path, data_maker)


@pytest.mark.parametrize("step", ["09", case("10"), "11"])
def test_resume_of_a_group_of_two_gpus_is_exact(step, tmp_path):
    """A tensor-parallel (09), context-parallel (10) or expert-parallel (11) group of 2 GPUs in bf16, whose
    collectives run inside every block: stopped and resumed, it ends with the uninterrupted run's weights (run_job
    skips with fewer GPUs)."""
    check_exact_resume(lambda *args: torchrun(2, SCRIPTS[step], *args, *VIT_LR, "--amp", "bf16"), tmp_path)


@pytest.mark.parametrize(("step", "amp"), [amp_case for amp_case in AMP_CASES if amp_case.values[0] >= "04"])
def test_two_processes_over_nccl(step, amp, tmp_path):
    """One process per GPU (run_job skips where there are fewer than 2): 08 as two stages, 09-11 as one
    tensor-parallel, context-parallel or expert-parallel group of two."""
    script = SCRIPTS[step]
    lr = LEARNING_RATES.get(step, [])
    result = check_ok(run_job(torchrun(2, script, *SMOKE_ARGS, *lr, "--amp", amp, "--output-dir", tmp_path),
                              timeout=300))
    assert not NONDETERMINISTIC.findall(result.stderr), NONDETERMINISTIC.findall(result.stderr)
    check_smoke_run(tmp_path, script, world_size=2, amp=amp, model_class=MODEL_CLASSES.get(step, models.ResNet9))
