"""Helpers that every step uses the same way and that are not the lesson.

Errors, seeding, deterministic kernels, RNG state, atomic writes, JSON settings files, the two objects that
every step's functions share (`Context`, what the run is; `State`, what training advances), the run's record
(its printed lines, history and metrics), and whether a resumed run had finished (`finished`, a collective
where there is a process group: 01-03 call it too). The distributed helpers live in
`common/distributed.py`.
"""

import argparse
import contextlib
import dataclasses
import gc
import glob
import json
import math
import os
import random
import shutil
import sys
import tempfile
import threading
import time
import traceback

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record


class UsageError(Exception):
    """Bad input: reported as one `error:` line, then exit status 2."""


BAD_INPUT_WAIT_SECONDS = 10  # how long a process that does not print the error line waits for the one that does
# Set once this process is asked to stop: SIGTERM or SIGUSR1, caught by common.distributed.Preemption, which
# also sets CATCHING_STOP_SIGNALS as it starts and records the first signal's name in STOP_SIGNAL.
STOP_REQUESTED = threading.Event()
CATCHING_STOP_SIGNALS = threading.Event()
STOP_SIGNAL = {"name": None}

PREEMPTED_EXIT_STATUS = 75  # sysexits.h's EX_TEMPFAIL: stopped before the end, to be continued


class Preempted(Exception):  # noqa: N818 a requested stop, not an error
    """SIGTERM or SIGUSR1 stopped the run at a step boundary, once every rank had saved its part of the
    checkpoint: reported as one `preempted:` line, then exit status 75; `--resume` continues."""

    def __init__(self, step, output_dir):
        super().__init__(f"{STOP_SIGNAL['name'] or 'a signal to another rank'} received; every rank stopped "
                         f"after step {step} and saved a checkpoint in {output_dir}: continue with --resume")


class _OneLineErrorHandler(ErrorHandler):
    """torchrun's error handler (what `record` writes to the file torchrun reads back), with bad input
    recorded as its one `error:` line instead of a traceback."""

    def record_exception(self, e):
        line = _error_line(e)
        if line is None:
            return super().record_exception(e)
        if os.environ.get("TORCHELASTIC_ERROR_FILE"):
            with open(os.environ["TORCHELASTIC_ERROR_FILE"], "w") as file:
                json.dump({"message": {"message": line, "extraInfo": {"py_callstack": line,
                                                                      "timestamp": str(int(time.time()))}}}, file)


def _error_line(error):
    if isinstance(error, UsageError):
        return f"error: {error}"
    if isinstance(error, dist.DistNetworkError):  # this process could not open or reach the rendezvous
        return f"error: cannot start the process group: {error}"
    if isinstance(error, Preempted):
        return f"preempted: {error}"
    return None


def _skips_shutdown(setting):
    """`run`'s skip_python_shutdown, its default (None) read once `main()` has run."""
    return CATCHING_STOP_SIGNALS.is_set() if setting is None else setting


def run(main, skip_python_shutdown=None):
    """Run a script's `main()`. Bad input (a UsageError, or a rendezvous that cannot start) ends the
    process with one `error:` line and exit status 2; a run stopped by a signal (`Preempted`), with one
    `preempted:` line and exit status 75; any other exception propagates with its traceback (when the
    process ends with `os._exit`, below, the traceback is printed and the exit status is 1).

    Every process finds the same bad input (the checks are deterministic), and each exits: none is left
    waiting in a collective. torchrun (and `accelerate launch`, which runs it) collects every worker's
    error through `record` and names the first in its failure table, so under torchrun the workers
    print nothing. Without torchrun, the first process of each machine prints the line, and the others
    exit with the same status once asked to stop (SIGTERM), or after 10 seconds: a launcher that stops every
    process once one has failed (DeepSpeed's, `srun --kill-on-bad-exit`, `mp.spawn`) stops them as soon as
    the first has printed and exited, and reports the first's status.

    How the process ends. A gloo process group still alive when Python shuts down can abort the process
    after a run that succeeded ("terminate called without an active exception", SIGABRT): its threads may
    still release the last collective's tensors, and Python's shutdown stops any thread that asks for the
    GIL by unwinding it through C++ code. So a group that `main()` left alive is destroyed here, and with
    `skip_python_shutdown=False` the process then ends as any Python program does, `atexit` handlers included (logging,
    TensorBoard and W&B flush there); the collector first frees wrappers caught in reference cycles
    (FSDP's), which hold the group. `tests/test_faults.py` runs a script that ends right after an
    all-reduce through this path.

    `skip_python_shutdown=True` ends the process with `os._exit` instead, once the output is flushed: no
    `atexit` handler, no finalizer runs. The default, None, is True in a process that catches the stop
    signals (`distributed.catch_stop_signals()`, every distributed step, from that call on) and False in
    the others: a script of yours with a process group that does not catch them passes True. The
    distributed steps need it, because a library can hold the
    group's threads beyond `destroy_process_group()` where the script cannot free them: 06, which
    ended normally after Accelerate's `end_training()`, aborted once in a CI run (3 processes, 2 cores).
    Nothing is lost: every file the steps write is complete and closed when `main()` returns. A script
    of yours that needs its `atexit` handlers calls their flush (`writer.close()`, `wandb.finish()`)
    at the end of `main()` before it uses this. A failed run ends the same way: its traceback can keep a
    data loader's iterator alive, whose worker processes Python's shutdown would then terminate and wait
    for, and they ignore SIGTERM (`distributed.Preemption`): the process would never end. With `os._exit`
    they see their trainer gone and end by themselves.
    """
    status = 0
    try:
        record(main, error_handler=_OneLineErrorHandler())()
    except (UsageError, dist.DistNetworkError) as error:
        reported_by_torchrun = bool(os.environ.get("TORCHELASTIC_ERROR_FILE"))
        first_of_its_machine = os.environ.get("LOCAL_RANK", "0") == "0"
        if not reported_by_torchrun and first_of_its_machine:
            print(_error_line(error), file=sys.stderr, flush=True)
        status = 2
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        if not reported_by_torchrun and not first_of_its_machine:
            # DeepSpeed's launcher, `srun --kill-on-bad-exit` and mp.spawn stop every process once one fails:
            # leaving first, this one could get the first killed before it printed the line. Their SIGTERM
            # ends the wait (Preemption blocks its default action, the end of the process). In slices: a signal
            # that a thread started before Preemption's block takes is handled in this thread, between them.
            deadline = time.monotonic() + BAD_INPUT_WAIT_SECONDS
            while not STOP_REQUESTED.wait(0.1) and time.monotonic() < deadline:
                pass
    except Preempted as preempted:
        distributed = dist.is_available() and dist.is_initialized()  # 06 in one process has no group
        if not distributed or dist.get_rank() == 0:  # also under torchrun: signalled, it prints no failure table
            print(_error_line(preempted), file=sys.stderr, flush=True)
        status = PREEMPTED_EXIT_STATUS
        if distributed:
            # Leave together: rank 0 may still be writing the checkpoint, and torchrun stops every worker once
            # one has exited with a failure.
            dist.barrier()
            dist.destroy_process_group()
    except SystemExit as request:  # sys.exit() inside main(): its status
        if request.code is not None and not isinstance(request.code, int):
            print(request.code, file=sys.stderr)  # sys.exit("message"), as Python would print it
        status = request.code if isinstance(request.code, int) else int(request.code is not None)
    except BaseException:
        if not _skips_shutdown(skip_python_shutdown):
            raise
        traceback.print_exc()  # under torchrun, `record` has written it to the error file too
        status = 1
    if _skips_shutdown(skip_python_shutdown):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    gc.collect()  # main()'s wrappers, with their references to the process group
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    sys.exit(status)


def seed_everything(seed):
    """Seed Python's and torch's random number generators (CPU and every GPU)."""
    random.seed(seed)
    torch.manual_seed(seed)


def use_deterministic_kernels(strict=False):
    """Only deterministic GPU kernels, so that two runs of one seed, and a run stopped and resumed, end
    with the same weights (`--resume` is exact).

    By default cuDNN chooses a convolution algorithm by heuristics, and it may be one that adds with atomics
    (as other kernels do), which rounds differently from run to run; training amplifies that within a few dozen
    steps. `torch.use_deterministic_algorithms` picks deterministic kernels, and warns (`warn_only`: a
    model of your own keeps running) on an operation that has none; cuBLAS needs
    CUBLAS_WORKSPACE_CONFIG for it, set before its first use. The mode would also fill every
    uninitialised tensor (`torch.empty`) with NaN, which matters only to code that reads memory before
    writing it, and costs DeepSpeed's ZeRO-1/2 a pass over its 2 GB gradient bucket at every step:
    that part stays off.

    `strict` stops at an operation that has no deterministic kernel instead (a RuntimeError that names it).
    Only then do attention's fused kernels (`F.scaled_dot_product_attention`'s flash and memory-efficient
    ones) run a deterministic backward pass; under `warn_only` they add with atomics. Steps 09-11 are
    strict. The others are not: a model of your own would stop at its first such operation, torchvision's
    VGG at `AdaptiveAvgPool2d((7, 7))`'s backward pass, for one. Strict, cuBLAS stops at its first
    product under another workspace setting: that is one error line here.
    """
    workspace = os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if strict and workspace not in (":4096:8", ":16:8"):
        raise UsageError(f"CUBLAS_WORKSPACE_CONFIG={workspace}: deterministic cuBLAS needs :4096:8 or :16:8; "
                         "unset it, and the step sets it")
    torch.use_deterministic_algorithms(True, warn_only=not strict)
    torch.utils.deterministic.fill_uninitialized_memory = False


def get_rng_state():
    """The random number generator state a checkpoint needs to resume a run exactly: this process's
    generators, its GPU's included (not every visible GPU's: a run resumed with fewer visible GPUs
    could not restore them)."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # the current device's, which the step has set
    return state


def set_rng_state(state):
    """Restore `get_rng_state()`'s result (tensors may arrive on a GPU through map_location)."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def check_finite(loss, step, which="training"):
    """A run whose loss is no longer a number has diverged: every later step is wasted, and its weights are
    NaN. Stop it with an error before it writes a checkpoint or a model over good ones."""
    if not math.isfinite(loss):
        raise UsageError(f"the {which} loss is {loss} at step {step}: the run diverged; "
                         "lower --lr, or raise --batch-size (docs/troubleshooting.md)")


def _atomic_write(path, write, mode):
    """Write through a temporary file in the same directory, then rename it over `path`.

    A crash mid-write leaves the previous file intact: `os.replace` is atomic on POSIX.
    """
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp_path = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        os.unlink(tmp_path)
        raise


def save_atomic(obj, path):
    """`torch.save(obj, path)`, atomically."""
    _atomic_write(path, lambda file: torch.save(obj, file), "wb")


def write_json(obj, path):
    """Write `obj` as indented JSON, atomically."""
    _atomic_write(path, lambda file: file.write(json.dumps(obj, indent=2) + "\n"), "w")


def write_outputs(output_dir, weights, metrics):
    """The run's outputs in `output_dir`, each written atomically: `model.pt` (the plain fp32 state dict that
    every step writes) and `metrics.json`. Called by one process."""
    save_atomic(weights, os.path.join(output_dir, "model.pt"))
    write_json(metrics, os.path.join(output_dir, "metrics.json"))


def write_text(text, path):
    """Write the string `text`, atomically."""
    _atomic_write(path, lambda file: file.write(text), "w")


def commit_checkpoint(directory, name):
    """Name the checkpoint `directory/name`, now complete, in `directory/latest` (atomically: a crash
    mid-save leaves `latest` naming the previous one), then delete the older ones."""
    write_text(name, os.path.join(directory, "latest"))
    remove_other_checkpoints(directory, keep=name)


def remove_other_checkpoints(directory, keep):
    """Delete every checkpoint directory in `directory` but `keep` (files stay: `latest`, DeepSpeed's
    zero_to_fp32.py): once the newest checkpoint is complete, the older ones are no longer needed."""
    for name in os.listdir(directory):
        if name not in (keep, "latest"):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def latest_checkpoint(directory):
    """The checkpoint directory that `directory/latest` names: 05 and 07-10 write `latest` last, atomically,
    once the checkpoint it names is complete."""
    latest = os.path.join(directory, "latest")
    if not os.path.isfile(latest):
        raise UsageError(f"--resume: no checkpoint in {directory}; run once with --save-every first")
    with open(latest) as file:
        return os.path.join(directory, file.read().strip())


def deepspeed_grad_scaler(engine):
    """The torch GradScaler that a DeepSpeed engine (0.19.8) scales fp16 losses with under `torch_autocast`: the
    engine's under ZeRO-0, its ZeRO optimizer's under ZeRO-1 to 3. DeepSpeed's checkpoints leave it out, so a
    resumed run would start again from the initial scale. Without fp16, a disabled one: its state is empty."""
    scaler = engine.torch_autocast_z0_gradscaler or getattr(engine.optimizer, "torch_autocast_gradscaler", None)
    return scaler or torch.amp.GradScaler(enabled=False)


def check_deepspeed_checkpoint(directory, engine, args):
    """Refuse, on every rank alike and before DeepSpeed `engine` loads anything (its strict load of another
    model's weights, or its search for another ZeRO stage's files, ends in a traceback): no checkpoint
    (`latest_checkpoint`'s error), a checkpoint of other settings than `args`' or of another ZeRO stage
    (`check_resumable`'s, from the client state that each model-states file holds), or ZeRO
    shards written by another number of processes. DeepSpeed re-partitions shards only through its universal
    checkpoint, and its converter (ds_to_universal, in 0.19.8) reads Adam's state alone: on SGD's it stops
    with KeyError: 'exp_avg'. Left to DeepSpeed, the ranks without a shard fail with an assertion while the
    others report the mismatch. ZeRO-0 writes no shard: every rank's copy of the optimizer state is whole,
    and any world size loads it."""
    path = latest_checkpoint(directory)
    model_states = sorted(glob.glob(os.path.join(path, "*model_states.pt")))
    if not model_states:
        raise UsageError(f"checkpoint {path} is incomplete (no model states); delete it to start over")
    # DeepSpeed loads it unrestricted; a restricted load would call an unusual but valid file corrupt.
    checkpoint = load_checkpoint(model_states[0], "cpu", weights_only=False)
    stage = engine.zero_optimization_stage()
    check_resumable(path, checkpoint, **resume_settings(args), zero_stage=stage)
    written_by, world_size = checkpoint["dp_world_size"], engine.dp_world_size  # as DeepSpeed's loader reads it
    if stage > 0 and written_by != world_size:
        raise UsageError(f"cannot resume from {directory} with {world_size} processes: its ZeRO shards were "
                         f"written by {written_by}, and DeepSpeed's universal checkpoint, which re-partitions "
                         f"shards, converts Adam's state only, not SGD's; resume with {written_by} processes")


def read_json(path, flag):
    """The JSON file that `flag` names, with one clear error when it is missing or malformed."""
    try:
        with open(path) as file:
            return json.load(file)
    except OSError as error:
        raise UsageError(f"{flag} {path}: {error.strerror}") from None
    except ValueError as error:
        raise UsageError(f"{flag} {path} is not valid JSON: {error}") from None


def load_checkpoint(path, map_location, weights_only=True):
    """`torch.load` with a clear error for a missing, truncated or corrupt checkpoint."""
    if not os.path.isfile(path):
        raise UsageError(f"--resume: no checkpoint at {path}; run once with --save-every first")
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as error:
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UsageError(f"checkpoint {path} is corrupt or truncated ({reason}); delete it to start over") from None


# Settings that check_resumable compares but that are not flags: how the error message names them.
_NOT_FLAGS = {"world_size": "number of processes"}
# The flags that a resumed run must share with its checkpoint: the batches (--batch-size, --seed), the schedule
# (--epochs), the model's shapes and layers (--width, --norm; 11's --experts, --top-k).
RESUME_SETTINGS = ("batch_size", "epochs", "seed", "width", "norm", "experts", "top_k")


def resume_settings(args):
    """What a checkpoint records of the run that wrote it, and a resumed run must share: the step's flags
    among RESUME_SETTINGS."""
    return {name: getattr(args, name) for name in RESUME_SETTINGS if hasattr(args, name)}


def check_resumable(path, checkpoint, **expected):
    """Refuse the checkpoint at `path` if it was written with other values of RESUME_SETTINGS (the batches,
    the schedule, the model's shapes and layers) or, where each process saves its own random state, by
    another number of processes."""
    for name, value in expected.items():
        flag = _NOT_FLAGS.get(name, "--" + name.replace("_", "-"))
        if name not in checkpoint:  # written before checkpoints recorded it: no value to resume with
            raise UsageError(f"{path} does not record its {flag}; use a new --output-dir")
        if checkpoint[name] != value:
            raise UsageError(f"{path} was written with {name}={checkpoint[name]}, this run has {value}; "
                             f"resume with the same {flag} or use a new --output-dir")


def report_resume(path, checkpoint):
    """Rank 0's one line once a checkpoint is loaded: where the run continues."""
    if is_main_process():
        print(f"resumed from {path}: epoch {checkpoint['epoch'] + 1}, step {checkpoint['step']}", flush=True)


def finished(output_dir, step, last_step):
    """Whether a run that resumed at `step` had already ended: trained to `last_step` and written the outputs
    of that step in `output_dir` (not those of an earlier, shorter run). It then leaves them as they are
    (evaluating again would rewrite them with an empty epoch's figures) and says so. Rank 0 decides, for
    every rank: all must return together."""
    done = [False]
    if step >= last_step and is_main_process():
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):  # none or unreadable: write them again
            with open(os.path.join(output_dir, "metrics.json")) as file:
                done = [json.load(file)["steps"] == step]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(done, src=0)
    if done[0] and is_main_process():
        past = f" of {last_step}" if step == last_step else f", past --max-steps {last_step}"
        print(f"nothing to train: {output_dir} holds step {step}{past}", flush=True)
    return done[0]


def is_main_process():
    """Rank 0, also before the process group exists (launchers set RANK in the environment)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


@dataclasses.dataclass(frozen=True)
class Context:
    """What the run is, built once by a step's `setup` and read by every function, reassigned by none: the
    arguments, where and in what precision it computes, and its place among the processes (a world of one
    before step 04; 06 keeps the `Accelerator` that connects them; 08-11 lay their ranks out on a mesh)."""

    args: argparse.Namespace
    device: torch.device
    amp_dtype: torch.dtype | None = None  # 02 on: None is plain fp32
    rank: int | None = None  # None: the process group's (04 on), or 0 without one
    world_size: int | None = None  # None: the process group's, or 1
    mesh: object = None  # a DeviceMesh (08-11)
    accelerator: object = None  # 06's Accelerator: its process group, device and wrappers

    def __post_init__(self):
        grouped = dist.is_available() and dist.is_initialized()
        if self.rank is None:  # frozen: set once, here
            object.__setattr__(self, "rank", dist.get_rank() if grouped else 0)
        if self.world_size is None:
            object.__setattr__(self, "world_size", dist.get_world_size() if grouped else 1)

    @property
    def replicas(self):
        """How many replicas of the model split each global batch: every process is one (04-07, and 11, whose
        mesh has no "dp" dimension); on a mesh, the size of its "dp" dimension (08's pipelines, 09's and 10's
        groups are one each)."""
        return self.mesh["dp"].size() if self._data_parallel_mesh else self.world_size

    @property
    def replica(self):
        """This process's replica, 0 to replicas - 1: the part of each global batch that it trains on."""
        return self.mesh.get_local_rank("dp") if self._data_parallel_mesh else self.rank

    @property
    def _data_parallel_mesh(self):
        return self.mesh is not None and "dp" in self.mesh.mesh_dim_names


@dataclasses.dataclass
class State:
    """What training advances and a checkpoint holds: the model, its optimizer, schedule and loss scaler, the
    optimizer steps done (all epochs together), the epoch in progress, and the step where the run ends."""

    model: object
    optimizer: object
    scheduler: object
    last_step: int  # --max-steps, or the schedule's end
    scaler: object = None  # 02 on
    step: int = 0
    epoch: int = 0


class RunRecord:
    """What a run reports, the same in every step: after each epoch, one line (printed by rank 0 alone) and an
    entry of the history (benchmarks/report.py plots it); at the end, the metrics of metrics.json: the run's
    settings, its last epoch's results, and its throughput, training samples per second over the timed spans
    (evaluation excluded).

    The settings hold the parallel layout of a step with a device mesh (08's stages, 09-11's group sizes) and
    `settings`, the run's own (05's ZeRO stage, 08's micro-batches...); `steps_per_epoch` counts optimizer steps."""

    # The metrics' names of a device mesh's dimensions; "dp", "edp": the replicas, which world_size implies.
    LAYOUT = {"pp": "stages", "tp": "tp_size", "cp": "cp_size", "ep": "ep_size"}

    def __init__(self, script, context, steps_per_epoch, data="cifar10", **settings):
        args, names = context.args, (context.mesh.mesh_dim_names or ()) if context.mesh is not None else ()
        layout = {self.LAYOUT[name]: context.mesh[name].size() for name in names if name in self.LAYOUT}
        self.epochs, self.steps_per_epoch, self.batch_size = args.epochs, steps_per_epoch, args.batch_size
        self.settings = {"script": os.path.basename(script), "data": "synthetic" if args.synthetic else data,
                         "device": context.device.type, "amp": getattr(args, "amp", "none"),
                         "world_size": context.world_size, **layout, **settings, "global_batch_size": args.batch_size}
        self.history, self.step, self.test_samples = [], 0, 0
        self.samples, self.seconds, self._started = 0, 0.0, None
        self.start_time = time.perf_counter()

    def start_training(self, step):
        """The start of a timed span, at optimizer step `step`."""
        self._synchronize()
        self._started = time.perf_counter(), step

    def stop_training(self, step):
        """The end of a timed span, at optimizer step `step`: each step trained --batch-size samples."""
        self._synchronize()
        started, first_step = self._started
        self.seconds += time.perf_counter() - started
        self.samples += (step - first_step) * self.batch_size

    @property
    def samples_per_second(self):
        return self.samples / self.seconds if self.seconds else 0.0

    def end_epoch(self, epoch, step, train_loss, test_loss, test_accuracy, test_samples, more=""):
        """Records the epoch that ended at `step`, and prints its line (with `more` at its end)."""
        check_finite(test_loss, step, "test")  # weights that are no longer numbers: write nothing from them
        self.step, self.test_samples = step, test_samples
        self.history.append({"step": step, "elapsed_seconds": time.perf_counter() - self.start_time,
                             "train_loss": train_loss, "test_loss": test_loss, "test_accuracy": test_accuracy})
        if is_main_process():
            print(f"epoch {epoch + 1}/{self.epochs}  step {step}  train_loss {train_loss:.4f}  "
                  f"test_loss {test_loss:.4f}  test_accuracy {test_accuracy:.4f}  "
                  f"samples/s {self.samples_per_second:.1f}  elapsed {self.history[-1]['elapsed_seconds']:.1f}s"
                  + (f"  {more}" if more else ""), flush=True)

    def metrics(self):
        """metrics.json's contents: the settings, then the last epoch's results; `wall_seconds` ends now (call it
        before the final writes, as the steps do)."""
        last = self.history[-1]
        return {**self.settings, "steps": self.step, "epochs_completed": self.step // self.steps_per_epoch,
                "train_loss": last["train_loss"], "test_loss": last["test_loss"],
                "test_accuracy": last["test_accuracy"], "test_samples": self.test_samples,
                "samples_per_second": self.samples_per_second,
                "wall_seconds": time.perf_counter() - self.start_time, "history": self.history}

    @staticmethod
    def _synchronize():
        # GPU work is asynchronous: without a sync the clock stops before the GPU has finished.
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
