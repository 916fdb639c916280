"""Running a step as a user runs it, as a subprocess under a hard timeout, and the arguments of the
tests' short runs."""

import importlib.util
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
from launch import ON_GPU, ROOT, environment

# A short run on any data: 24 divides by 1, 2, 3 and 4 processes, and the synthetic training set
# (2,400 samples) gives 100 steps per epoch. No loader workers: 2 per process would add processes to start
# and share the 2 cores in every run, and these runs check what the training computes, which the workers do not
# change. The README's own commands, the preemption and the Slurm jobs run with the default workers.
SHORT_RUN_ARGS = ["--num-workers", "0", "--batch-size", "24", "--lr", "0.1", "--epochs", "1"]
SYNTHETIC_ARGS = ["--synthetic", *SHORT_RUN_ARGS]
# The models at a quarter of their default widths (ResNet-9's 32, the vision transformer's 128): a tenth of the
# arithmetic, for the runs whose claim holds at any width (an exact resume, parity, what a checkpoint holds).
SMALL_RESNET9, SMALL_VIT = ["--width", 8], ["--width", 32]
# A smoke run: enough steps for every step's net to beat chance clearly on the synthetic data.
SMOKE_STEPS = 30
SMOKE_ARGS = [*SYNTHETIC_ARGS, "--max-steps", str(SMOKE_STEPS)]
# 06's CNN has no normalisation layers: SGD needs a smaller step than ResNet-9's at this small batch.
MNIST_LR = ["--lr", "0.05"]
# 09's AdamW moves every weight by about its step size: 0.1, SGD's rate above, would throw the transformer about.
VIT_LR = ["--lr", "1e-3"]


def with_default_workers(args):
    """`args` without `--num-workers N`: the run keeps the default loader workers, as a user's does."""
    args = list(args)
    index = args.index("--num-workers")
    return args[:index] + args[index + 2:]


# bf16 and fp16 on a CPU. A CPU without bf16 instructions (AVX2 only) emulates bf16: with kernels held to AVX2,
# 02's step ran 17 times slower in bf16 than in fp32 at the CPU's own kernels (docs/mixed-precision.md), and
# most CPUs emulate fp16: a smoke run of ResNet-9 at its default width took 100-145 s there.
# The 16-bit runs train it at half the width (a quarter of the FLOPs, still learning in SMOKE_STEPS steps),
# under a timeout with room for a CPU twice as slow again.
def sized_for(amp):
    """(extra arguments, timeout, width) of a smoke run in `amp`: half the width and a 9-minute timeout in
    16 bits (under pytest's 600 s per test, so that a job that hangs fails with its own output), ResNet-9's
    default width and 3 minutes in fp32."""
    return (["--width", "16"], 540, 16) if amp != "none" else ([], 180, 32)


def _children():
    """{parent pid: [child pids]} for every process on the machine."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
    return children


def _descendants(pid):
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    children = _children()
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _tree(process):
    """`process` and every process below it."""
    return [process.pid, *_descendants(process.pid)]


def _signal(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_tree(process):
    # The tree as it is now: once the launcher is gone, its workers would no longer be found below it.
    pids = _tree(process)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        _signal(pids, sig)
        try:
            return process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    return process.communicate()


def import_script(path):
    """The repository's script at `path` as a module, as a user's code imports it (its `__main__` block not run)."""
    spec = importlib.util.spec_from_file_location(f"script_{Path(path).stem}", ROOT / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def workers(process):
    """{rank: pid} of the worker processes that a launcher (`process`, e.g. torchrun) runs now."""
    found = {}
    for pid in _children().get(process.pid, []):
        try:
            variables = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it has just exited
            continue
        for variable in variables:
            if variable.startswith(b"RANK="):
                found[int(variable[len(b"RANK="):])] = pid
    return found


def loader_workers(pid):
    """The pids of process `pid`'s data-loader workers that have started (its children, or its forkserver's,
    common/data.py): PyTorch names a worker `pt_data_worker` once it has set its own signal handlers, which
    end it on SIGTERM unless the signal is blocked."""
    found = []
    for child in _descendants(pid):
        try:
            if Path(f"/proc/{child}/comm").read_text().strip() == "pt_data_worker":
                found.append(child)
        except OSError:  # it has just exited
            continue
    return found


def catches(pid, number, mask="SigCgt"):
    """Whether process `pid` has a handler of its own for signal `number` (/proc's SigCgt mask): a signal sent
    before that ends it by the signal's default action instead. `mask="SigBlk"`: whether its main thread blocks
    the signal instead."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # it has just exited
        return False
    bits = int(status.split(f"{mask}:")[1].split()[0], 16)
    return bool(bits >> (number - 1) & 1)


def processes_per_machine(command):
    """How many processes a launcher's command line starts on this machine (1 without a launcher)."""
    for index, arg in enumerate(command):
        for option in ("--nproc_per_node=", "--num_gpus="):
            if arg.startswith(option):
                return int(arg[len(option):])
        if arg == "--num_processes":
            return int(command[index + 1])
    return 1


def run_job(command, timeout=180, env=None, poll=None, more_processes_than_gpus=False, cwd=ROOT):
    """Run `command` in `cwd` (the repository root); a job that outlasts `timeout` is killed, with every
    process below it, and fails the test.

    `poll(process)`, if given, is called about every 0.1 s while the job runs (to inject a fault).
    On a GPU machine every process needs a GPU of its own (NCCL): a command that starts more processes
    than there are GPUs is skipped, unless that is what it tests."""
    if ON_GPU and not more_processes_than_gpus and processes_per_machine(command) > torch.cuda.device_count():
        pytest.skip(f"{processes_per_machine(command)} processes need as many GPUs; "
                    f"this machine has {torch.cuda.device_count()}")
    process = subprocess.Popen(command, cwd=cwd, env=environment(env), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                # Waiting in communicate() keeps reading the pipes: a full pipe would stall the job.
                stdout, stderr = process.communicate(timeout=0.1 if poll else timeout)
                return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                if poll:
                    poll(process)
    except BaseException:  # a failed check in `poll`, or Ctrl-C: leave nothing running
        _kill_tree(process)
        raise
    stdout, stderr = _kill_tree(process)
    pytest.fail(f"hung: killed after {timeout}s: {' '.join(map(str, command))}\n{stdout[-3000:]}\n{stderr[-3000:]}")


def kill_node(process):
    """SIGKILL a launcher and every process below it at once, as when its machine dies."""
    _signal(_tree(process), signal.SIGKILL)


def run_nodes(commands, timeout=180, envs=None, poll=None):
    """Run the launchers of one job's nodes (one command each) side by side in the repository root, as if
    on machines of their own; returns each node's CompletedProcess once every node has exited. A job that
    outlasts `timeout` is killed, every node's processes with it, and fails the test.

    `envs`: each node's extra environment. `poll(processes)`, if given, is called about every 0.1 s while
    the nodes run (to inject a fault)."""
    if ON_GPU:
        pytest.skip("nodes on one machine would share its GPUs, and NCCL takes one process per GPU")
    processes, outputs = [], []
    for command, node_env in zip(commands, envs or [None] * len(commands), strict=True):
        # Files, not pipes: nobody reads a node's output while waiting for another's, and a full pipe stalls.
        stdout, stderr = (tempfile.TemporaryFile("w+", encoding="utf-8", errors="replace") for _ in range(2))
        outputs.append((stdout, stderr))
        processes.append(subprocess.Popen(command, cwd=ROOT, env=environment(node_env), stdout=stdout, stderr=stderr,
                                          start_new_session=True))

    def completed(kill=False):
        results = []
        for process, files in zip(processes, outputs, strict=True):
            if kill:
                _kill_tree(process)
            texts = []
            for file in files:
                file.seek(0)
                texts.append(file.read())
                file.close()
            results.append(subprocess.CompletedProcess(process.args, process.wait(), *texts))
        return results

    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if all(process.poll() is not None for process in processes):
                return completed()
            if poll:
                poll(processes)
            time.sleep(0.1)
    except BaseException:  # a failed check in `poll`, or Ctrl-C: leave nothing running
        completed(kill=True)
        raise
    report = "\n".join(f"node {node}:\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
                       for node, result in enumerate(completed(kill=True)))
    pytest.fail(f"hung: killed after {timeout}s: {' '.join(map(str, commands[0]))}\n{report}")
