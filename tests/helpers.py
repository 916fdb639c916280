"""Launch the step scripts the way a user does, as subprocesses, under a hard timeout."""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common import data, models

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
BIN = Path(sys.executable).parent
ON_GPU = torch.cuda.is_available()
README = (ROOT / "README.md").read_text()
# The environment's bin first on PATH, as when it is activated: DeepSpeed builds and loads its op with
# the ninja installed beside it (it fails without one on PATH, even with the op cached), and always
# the same ninja (two ninja versions disagree about the cached build and rebuild it every time).
DEEPSPEED_ENV = {"PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"}

# Small settings for quick runs: 24 divides by 1, 2, 3 and 4 processes, and the synthetic training
# set (2,400 samples) gives 100 steps per epoch.
QUICK = ["--num-workers", "0", "--batch-size", "24", "--lr", "0.1", "--epochs", "1"]
FAST = ["--synthetic", *QUICK]
# A smoke run: enough steps for every step's net to beat chance clearly on the synthetic data.
SMOKE_STEPS = 30
SMOKE = [*FAST, "--max-steps", str(SMOKE_STEPS)]


def python(script, *args):
    return [sys.executable, script, *map(str, args)]


def torchrun(nproc, script, *args, options=()):
    """torchrun's command line; `options` are more of torchrun's own (for example --max-restarts=1)."""
    # --standalone: a private rendezvous on a free port, so concurrent jobs cannot collide.
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", *options, script, *map(str, args)]


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def deepspeed(nproc, script, *args, port=None):
    """The deepspeed launcher; on a CPU --num_gpus is the number of processes. A free port instead of
    the launcher's fixed default (29500), so that concurrent jobs cannot collide."""
    return [str(BIN / "deepspeed"), f"--num_gpus={nproc}", f"--master_port={port or free_port()}", script,
            *map(str, args)]


def accelerate_launch(nproc, script, *args, config_precision=ON_GPU):
    """`accelerate launch` with the repository's config, as the README says. Its fp16 needs a GPU: on
    a CPU machine it is overridden unless `config_precision`. Port 0: a free port, so concurrent jobs
    cannot collide."""
    return [str(BIN / "accelerate"), "launch", "--config_file", "accelerate_config.yaml", "--num_processes", str(nproc),
            "--main_process_port", "0", *([] if config_precision else ["--mixed_precision", "no"]),
            script, *map(str, args)]


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


def _kill_tree(process):
    pids = [process.pid, *_descendants(process.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        try:
            return process.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    return process.communicate()


def workers(process):
    """{rank: pid} of the worker processes that a launcher (`process`, e.g. torchrun) runs now."""
    found = {}
    for pid in _children().get(process.pid, []):
        try:
            environment = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:  # it has just exited
            continue
        for variable in environment:
            if variable.startswith(b"RANK="):
                found[int(variable[len(b"RANK="):])] = pid
    return found


def processes_per_machine(command):
    """How many processes a launcher's command line starts on this machine (1 without a launcher)."""
    for index, arg in enumerate(command):
        for option in ("--nproc_per_node=", "--num_gpus="):
            if arg.startswith(option):
                return int(arg[len(option):])
        if arg == "--num_processes":
            return int(command[index + 1])
    return 1


def run(command, timeout=180, env=None, poll=None, more_processes_than_gpus=False):
    """Run `command` in the repository root; a run that outlasts `timeout` is killed and fails.

    `poll(process)`, if given, is called about every 0.1 s while the command runs (to inject a fault).
    On a GPU machine every process needs a GPU of its own (NCCL): a command that starts more processes
    than there are GPUs is skipped, unless that is what it tests."""
    if ON_GPU and not more_processes_than_gpus and processes_per_machine(command) > torch.cuda.device_count():
        pytest.skip(f"{processes_per_machine(command)} processes need as many GPUs; "
                    f"this machine has {torch.cuda.device_count()}")
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                # Waiting in communicate() keeps reading the pipes: a full pipe would stall the command.
                stdout, stderr = process.communicate(timeout=0.1 if poll else timeout)
                return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
            except subprocess.TimeoutExpired:
                if poll:
                    poll(process)
    except BaseException:  # a failed check in `poll`, or Ctrl-C: leave nothing running
        _kill_tree(process)
        raise
    stdout, stderr = _kill_tree(process)
    pytest.fail(f"hung: killed after {timeout}s: {' '.join(command)}\n{stdout[-3000:]}\n{stderr[-3000:]}")


def check_ok(result):
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    return result


def error_lines(result):
    return [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("error:")]


def check_one_error(result, *fragments):
    """A failed run that printed exactly one `error:` line containing every fragment."""
    assert result.returncode != 0, f"should have failed\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    lines = error_lines(result)
    assert len(lines) == 1, f"expected one error line, got {lines}\n{result.stderr[-3000:]}"
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def read_metrics(output_dir):
    return json.loads((Path(output_dir) / "metrics.json").read_text())


def load_state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def assert_same_weights(path_a, path_b):
    a, b = load_state(path_a), load_state(path_b)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"{len(different)} tensors differ, first: {different[:3]}"


METRIC_KEYS = {"script", "data", "device", "amp", "world_size", "global_batch_size", "steps", "epochs_completed",
               "train_loss", "test_loss", "test_accuracy", "test_samples", "samples_per_second", "wall_seconds"}


def check_run(output_dir, script, world_size, amp="none", model_class=models.ResNet9):
    """A SMOKE run that learned and wrote the contract's outputs."""
    metrics = read_metrics(output_dir)
    assert METRIC_KEYS <= metrics.keys()
    assert metrics["script"] == script
    device = "cuda" if ON_GPU and script != "01_cifar10_cpu.py" else "cpu"
    assert (metrics["data"], metrics["device"], metrics["amp"]) == ("synthetic", device, amp)
    assert metrics["world_size"] == world_size
    assert (metrics["global_batch_size"], metrics["steps"], metrics["epochs_completed"]) == (24, SMOKE_STEPS, 0)
    # Every test sample counted exactly once, whatever the world size (1,001 divides by none of 2-6).
    assert metrics["test_samples"] == data.SYNTHETIC_TEST_SIZE
    # Learned: an untrained net scores chance (0.10) at a loss of about ln(10).
    assert metrics["test_accuracy"] > 0.25
    assert metrics["test_loss"] < 0.9 * math.log(10)
    assert metrics["train_loss"] < math.log(10)
    assert metrics["samples_per_second"] > 0
    # A plain fp32 state_dict (no "module." prefix, no half-precision copy) that loads on the CPU.
    state = load_state(output_dir / "model.pt")
    assert all(tensor.dtype == torch.float32 for tensor in state.values() if tensor.is_floating_point())
    model = models.load_weights(output_dir / "model.pt", model_class)
    assert models.count_parameters(model) > 1_000_000
    return metrics


def tiny_cifar10(data_dir, train_size, test_size):
    """A --data-dir in the array layout (common/data.py) with random images: a data set of any size."""
    data_dir.mkdir()
    generator = np.random.default_rng(0)
    for name, size in (("train", train_size), ("test", test_size)):
        np.savez(data_dir / f"{name}.npz", images=generator.integers(0, 256, (size, 32, 32, 3), dtype=np.uint8),
                 labels=generator.integers(0, 10, size, dtype=np.uint8))
    return data_dir


def tiny_mnist(data_dir, train_size, test_size):
    """A --data-dir in torchvision's MNIST layout (the four IDX files, uncompressed, in MNIST/raw/)
    with random digits: a data set of any size, which torchvision loads offline."""
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    generator = np.random.default_rng(0)
    for name, size in (("train", train_size), ("t10k", test_size)):
        images = generator.integers(0, 256, (size, 28, 28), dtype=np.uint8)
        labels = generator.integers(0, 10, size, dtype=np.uint8)
        # IDX: a magic number (0x08 = unsigned bytes, then the number of dimensions), the sizes as
        # big-endian int32, the data.
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = np.array([0x0800 + array.ndim, *array.shape], dtype=">i4").tobytes()
            (raw / f"{name}-{kind}-ubyte").write_bytes(header + array.tobytes())
    return data_dir


# Resume on a small data set, 10 steps of 24 samples per epoch, for two epochs: the first run stops
# in the middle of epoch 1, between two checkpoints; the resumed run crosses into epoch 2.
RESUME_TRAIN_SIZE, RESUME_TEST_SIZE, RESUME_STEPS_PER_EPOCH = 240, 10, 10
STOP, END, SAVE_EVERY = 6, 14, 4
assert STOP < RESUME_STEPS_PER_EPOCH < END < 2 * RESUME_STEPS_PER_EPOCH and STOP % SAVE_EVERY


def check_exact_resume(launch, tmp_path, make_data=tiny_cifar10, env=None):
    """A run stopped at STOP and resumed to END ends with the weights and metrics of a run straight to
    END. `launch(*args)` gives the command line; `make_data` writes the data set. Returns the stopped
    run's output directory and its arguments, without --max-steps."""
    data_dir = make_data(tmp_path / "data", RESUME_TRAIN_SIZE, RESUME_TEST_SIZE)
    args = ["--data-dir", data_dir, *QUICK, "--epochs", 2, "--save-every", SAVE_EVERY]
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    check_ok(run(launch(*args, "--max-steps", END, "--output-dir", straight), env=env))
    check_ok(run(launch(*args, "--max-steps", STOP, "--output-dir", stopped), env=env))
    resumed = check_ok(run(launch(*args, "--max-steps", END, "--resume", "--output-dir", stopped), env=env))
    assert f"resumed from step {STOP}" in resumed.stdout
    assert_same_weights(straight / "model.pt", stopped / "model.pt")
    a, b = read_metrics(straight), read_metrics(stopped)
    assert (b["steps"], b["epochs_completed"]) == (END, END // RESUME_STEPS_PER_EPOCH)
    assert (a["test_loss"], a["test_accuracy"]) == (b["test_loss"], b["test_accuracy"])
    return stopped, args


def mnist_data_dir(tmp_path):
    """A fresh --data-dir holding only the official MNIST archives (from ../shared/data), as
    torchvision's download leaves them: loading then runs torchvision's real path (md5 check,
    extraction), offline. Skips the test where ../shared is absent (a user's checkout)."""
    archives = SHARED_DATA / "MNIST" / "raw"
    if not archives.is_dir():
        pytest.skip(f"the MNIST archives are not in {archives}: the tests need ../shared/data beside the checkout")
    data_dir = tmp_path / "data"
    shutil.copytree(archives, data_dir / "MNIST" / "raw")
    return data_dir
