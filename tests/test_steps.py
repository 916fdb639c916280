"""Each step, launched as the README launches it, writes the contract's outputs; run longer, it learns.

Each step runs once as a reader copies it from the README's tour table (the column "on a CPU-only
machine"), with every default (2 loader workers, the global batch of 256, the model's width), only shortened:
`--synthetic --max-steps 1`: 04 and 06 in the quick tier, the others in the full tier (each launch is 20-40 s
of Python starting: torch imported by the launcher, each rank and each loader worker; the quick tier runs 04-11
through their parity rows, 01 as their reference, and 02 and 03 only in the full tier). The full tier's runs
(`-m full`) train 30 steps and check learning."""

import re
import shlex
import sys

import pytest
from jobs import SMOKE_ARGS, processes_per_machine, run_job, sized_for
from launch import BIN, ON_GPU, ROOT, SCRIPTS, free_port, python, torchrun
from outputs import (
    MIXTURE_OF_EXPERTS,
    check_no_shared_memory_left,
    check_ok,
    check_outputs,
    check_smoke_run,
)

from common import models

README_STEPS = 1  # a run with the README's defaults, cut short: 1 optimizer step, then evaluation and outputs
MODELS = {"06_mnist_accelerate.py": models.MnistCNN, "09_cifar10_tensor_parallel.py": models.VisionTransformer,
          "10_cifar10_context_parallel.py": models.VisionTransformer,
          "11_cifar10_expert_parallel.py": MIXTURE_OF_EXPERTS}


def readme_cpu_commands():
    """{script: its command} from the README's tour table, column "on a CPU-only machine"."""
    rows = re.findall(r"^\| \d\d \| `(\d\d_\w+\.py)` \|.*\| `([^`]+)` \| (?:\d+ lines vs `\d\d_\w+\.py`|—) \|$",
                      (ROOT / "README.md").read_text(), flags=re.M)
    return dict(rows)


def as_launched(command, *more_args):
    """A README command line (`VARIABLE=value` first, a launcher, a script) as a process to start: its words,
    the environment it sets, `more_args` added after the script's own."""
    words = shlex.split(command)
    env = {}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    launcher = sys.executable if words[0] == "python" else str(BIN / words[0])
    if words[0] == "deepspeed":  # a free port instead of its fixed 29500, which another job here may hold
        words.insert(1, f"--master_port={free_port()}")
    return [launcher, *words[1:], *map(str, more_args)], env


def test_the_readme_launches_every_step():
    assert sorted(readme_cpu_commands()) == sorted(SCRIPTS.values())


# The mutation check's targets (tests/mutants.py) stay quick: 04's test-sample count, 06's gather_for_metrics.
QUICK_LAUNCHES = {"04_cifar10_ddp.py", "06_mnist_accelerate.py"}


@pytest.mark.parametrize("script", [pytest.param(script, marks=() if script in QUICK_LAUNCHES else pytest.mark.full)
                                    for script in sorted(SCRIPTS.values())])
def test_the_readme_command_with_its_defaults_writes_the_contracts_outputs(script, tmp_path):
    command, env = as_launched(readme_cpu_commands()[script], "--synthetic", "--max-steps", README_STEPS,
                               "--output-dir", tmp_path)
    # 2 loader workers per process start in a few seconds, and 16-bit runs are not in the CPU column.
    result = check_ok(run_job(command, env=env, timeout=300))
    world_size = processes_per_machine(command)
    check_outputs(tmp_path, script, world_size, model_class=MODELS.get(script, models.ResNet9), steps=README_STEPS,
                  batch_size=256)
    # Rank 0 alone prints: one summary line, not one per process.
    assert result.stdout.count("epoch 1/10 ") == 1, result.stdout[-2000:]
    port = next((word.split("=")[1] for word in command if word.startswith("--master_port=")), None)
    if port:  # the deepspeed launcher's
        check_no_shared_memory_left(port)


@pytest.mark.full
@pytest.mark.parametrize("script, extra", [
    ("01_cifar10_cpu.py", ["--num-workers", "2"]),  # the default loader, with worker processes
    ("02_cifar10_gpu.py", ["--amp", "bf16"]),
    ("02_cifar10_gpu.py", ["--amp", "fp16"]),  # torch scales fp16 losses on the CPU too
    ("03_cifar10_dataparallel.py", []),
])
def test_single_process_step(script, extra, tmp_path):
    amp = extra[1] if "--amp" in extra else "none"
    size, timeout, width = sized_for(amp)
    result = check_ok(run_job(python(script, *SMOKE_ARGS, *size, "--output-dir", tmp_path, *extra), timeout=timeout))
    check_smoke_run(tmp_path, script, world_size=1, amp=amp, width=width)
    if script != "01_cifar10_cpu.py":
        assert ("no GPU found" in result.stdout) != ON_GPU


@pytest.mark.full
@pytest.mark.parametrize("nproc", [2, 3])
def test_ddp_step(nproc, request, tmp_path):
    if nproc == 2:  # the run that other tests compare with (conftest.py)
        tmp_path, result = request.getfixturevalue("ddp_run")
    else:
        result = check_ok(run_job(torchrun(nproc, "04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", tmp_path)))
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=nproc)
    # Rank 0 alone prints: one summary line, not one per process.
    assert result.stdout.count("epoch 1/1") == 1


@pytest.mark.full
def test_ddp_step_without_a_launcher_is_a_world_of_one(tmp_path):
    check_ok(run_job(python("04_cifar10_ddp.py", *SMOKE_ARGS, "--output-dir", tmp_path), timeout=120))
    check_smoke_run(tmp_path, "04_cifar10_ddp.py", world_size=1)
