"""Launch the step scripts the way a user does, as subprocesses, under a hard timeout."""

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common import data, models

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"
BIN = Path(sys.executable).parent
ON_GPU = torch.cuda.is_available()

# Small settings for quick runs on the synthetic data: 24 divides by 1, 2, 3 and 4 processes, and
# the synthetic training set (2,400 samples) gives 100 steps per epoch.
FAST = ["--synthetic", "--num-workers", "0", "--batch-size", "24", "--lr", "0.1", "--epochs", "1"]
STEPS_PER_EPOCH = 100
# A smoke run: STEPS optimizer steps with FAST settings, checked by `check_run`.
STEPS = 30


def python(script, *args):
    return [sys.executable, script, *map(str, args)]


def torchrun(nproc, script, *args):
    # --standalone: a private rendezvous on a free port, so concurrent jobs cannot collide.
    return [str(BIN / "torchrun"), "--standalone", f"--nproc_per_node={nproc}", script, *map(str, args)]


def _descendants(pid):
    """Every process below `pid` (torchrun starts its workers in sessions of their own)."""
    children = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(entry.name))
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


def run(command, timeout=180, env=None):
    """Run `command` in the repository root; a run that outlasts `timeout` is killed and fails."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "PYTHONUNBUFFERED": "1", **(env or {})}
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stdout, stderr = _kill_tree(process)
        pytest.fail(f"hung: killed after {timeout}s: {' '.join(command)}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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


def check_run(output_dir, script, world_size, amp="none"):
    """A smoke run of STEPS steps with FAST settings that learned and wrote the contract's outputs."""
    metrics = read_metrics(output_dir)
    assert METRIC_KEYS <= metrics.keys()
    assert metrics["script"] == script
    device = "cuda" if ON_GPU and script != "01_cifar10_cpu.py" else "cpu"
    assert (metrics["data"], metrics["device"], metrics["amp"]) == ("synthetic", device, amp)
    assert metrics["world_size"] == world_size
    assert (metrics["global_batch_size"], metrics["steps"], metrics["epochs_completed"]) == (24, STEPS, 0)
    # Every test sample counted exactly once, whatever the world size (1,001 divides by none of 2-6).
    assert metrics["test_samples"] == data.SYNTHETIC_TEST_SIZE
    # Learned: an untrained net scores chance (0.10) at a loss of about ln(10).
    assert metrics["test_accuracy"] > 0.25
    assert metrics["test_loss"] < 0.9 * math.log(10)
    assert metrics["train_loss"] < math.log(10)
    assert metrics["samples_per_second"] > 0
    model = models.load_weights(output_dir / "model.pt")  # a plain state_dict, no "module." prefix
    assert models.count_parameters(model) > 1_000_000
    return metrics
