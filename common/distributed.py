"""Small distributed helpers. Each is also correct in a single process (a world of one; those that
communicate then need a process group of one), except `smoothing_term`, which takes 09's logits split
across a tensor-parallel group (DTensors)."""

import contextlib
import datetime
import os
import signal
import threading
from multiprocessing import resource_tracker

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common import models, utils
from common.utils import UsageError

# How long a collective waits for a missing rank before the job fails: 5 minutes, not gloo's default 30
# (NCCL's 10), so that a job whose rank died fails soon.
TIMEOUT = datetime.timedelta(minutes=5)


def print0(*args, **kwargs):
    """`print` on rank 0 only, so that N processes do not print every line N times."""
    if utils.is_main_process():
        print(*args, **kwargs, flush=True)


def all_reduce_mean(value):
    """The mean of a scalar tensor over all ranks (for logging: every rank must call it)."""
    if not dist.is_initialized():
        return value
    value = value.detach().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value / dist.get_world_size()


def broadcast_buffers(model, group=None):
    """Give every rank of `group` (default: all) the buffers of the group's first rank (BatchNorm's running
    statistics). DDP broadcasts them itself, but only in its first forward pass and in each that follows a
    training step, and only on the ranks that run one; FSDP and DeepSpeed never do. Every rank of the group
    must call it."""
    for buffer in model.buffers():
        dist.broadcast(buffer, group=group, group_src=0)


def average_gradients(module, group):
    """What DDP does in backward, for a module that it cannot wrap (08's pipeline stage): average `module`'s
    gradients over the ranks of `group`, in one all-reduce of them all, flattened (one collective per step,
    not one per tensor). Every parameter must have a gradient; every rank of the group must call it."""
    gradients = [parameter.grad for parameter in module.parameters()]
    flat = torch.cat([gradient.flatten() for gradient in gradients])
    dist.all_reduce(flat, group=group)
    flat /= dist.get_world_size(group)
    for gradient, average in zip(gradients, flat.split([gradient.numel() for gradient in gradients]), strict=True):
        gradient.copy_(average.view_as(gradient))


def gather_weights(part, send):
    """Rank 0 receives the state_dicts `part` of the ranks where `send` is true, merged into one, on the CPU;
    the other ranks receive None. Every rank must call it, once per run: it creates a gloo group, which lives
    as long as the process group (under NCCL, `gather_object` would pad every rank's pickle to the largest and
    gather them all onto rank 0's GPU)."""
    part = {key: value.cpu() for key, value in part.items()} if send else {}
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(part, parts, dst=0, group=dist.new_group(backend="gloo", timeout=TIMEOUT))
    return {key: value for received in parts for key, value in received.items()} if parts else None


# How often torchrun (--max-restarts) and Slurm (a requeued job) have started this job again.
RESTART_COUNTS = ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")


def should_resume(resume, *path):
    """Whether to load the checkpoint at `path` (a file, its parts joined): --resume, or a job started again
    where a rank finds one. Decided from what every rank sees, the same on every rank: if some ranks see it and
    others cannot (no file system shared by the machines, or one that lags), every rank stops with one error,
    instead of some starting at step 0 while the others resume (their collectives would mis-pair), or all of
    them starting over because rank 0 landed on a machine without it. Every rank must call it."""
    checkpoint = os.path.join(*path)
    restarted = any(int(os.environ.get(name, "0")) > 0 for name in RESTART_COUNTS)
    views = [(os.path.isfile(checkpoint), restarted)]
    if dist.is_initialized():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, (os.path.isfile(checkpoint), restarted))
    seen = [found for found, _ in views]
    # Each machine's torchrun counts its own restarts (one whose workers were still running restarts them
    # without counting): a restart anywhere is a restart for all.
    if not (resume or any(again for _, again in views) and any(seen)):
        return False
    blind = [str(rank) for rank, found in enumerate(seen) if not found]
    if blind and len(blind) < len(seen):  # none sees it: load_checkpoint's own error, on every rank
        raise UsageError(f"rank(s) {', '.join(blind)} cannot see {checkpoint}, which the others see: put "
                         "--output-dir on a file system that every machine shares (or remove the checkpoint, if an "
                         "earlier job left it)")
    return True


def default_to_a_world_of_one():
    """Started by plain `python`, no launcher has set the environment that `init_process_group`
    reads: set it for a world of one process. Port 0: the OS picks a free port, since no other
    process has to find it."""
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT="0")


def require_one_gpu_per_process():
    """NCCL needs a GPU of its own for every process: refuse more processes on this machine than it
    has GPUs (torchrun calls their number LOCAL_WORLD_SIZE, the deepspeed launcher LOCAL_SIZE)."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
    if processes > torch.cuda.device_count():
        raise UsageError(f"{processes} processes on this machine but {torch.cuda.device_count()} GPU(s): "
                         "start one process per GPU (--nproc_per_node, --num_gpus)")


def require_divisible_batch(batch_size, world_size):
    """`--batch-size` is the global batch: every process takes an equal share of it."""
    if batch_size % world_size:
        raise UsageError(f"--batch-size {batch_size} is not divisible by the world size {world_size}")


def pipeline_layout(args, world_size):
    """Step 08's layout, (stages, replicas), said in one line by rank 0: `--stages` pipeline stages, each
    replicated across the rest of the world. By default every rank is a stage, within ResNet-9's 5 blocks
    and `--microbatches` (1F1B's steady state runs a micro-batch per stage); some world sizes (5 or 7 with 4
    micro-batches) then get no pipeline, and the line says why. Input that does not fit is one UsageError."""
    blocks = len(models.RESNET9_BLOCKS)
    most = min(world_size, blocks, args.microbatches)
    stages = args.stages or max(count for count in range(1, most + 1) if world_size % count == 0)
    if world_size % stages or stages > blocks:
        raise UsageError(f"--stages {stages} must divide the world size {world_size} and be at most {blocks}, "
                         "ResNet-9's blocks")
    if args.schedule == "1f1b" and args.microbatches < stages:
        raise UsageError(f"--schedule 1f1b needs at least as many --microbatches as --stages ({stages})")
    replicas = world_size // stages
    if args.batch_size % (replicas * args.microbatches):  # each replica cuts its share into micro-batches
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by {replicas} replica(s) x "
                         f"--microbatches {args.microbatches}")
    no_pipeline = not args.stages and stages == 1 and world_size > 1
    print0(f"{stages} stage(s) x {replicas} replica(s)"
           + (f": no stage count from 2 to {most} divides {world_size} (--help)" if no_pipeline else ""))
    return stages, replicas


def tensor_parallel_layout(args, world_size):
    """Step 09's layout, (tp_size, replicas): groups of `--tp-size` ranks compute each layer together, each
    holding whole attention heads (group_layout)."""
    return group_layout(args, world_size, "--tp-size", args.tp_size, models.VIT_HEADS, "attention heads")


def context_parallel_layout(args, world_size):
    """Step 10's layout, (cp_size, replicas): groups of `--cp-size` ranks share each image, each holding an
    equal share of its tokens (group_layout)."""
    return group_layout(args, world_size, "--cp-size", args.cp_size, models.VIT_TOKENS, "tokens")


def expert_parallel_layout(args, world_size):
    """Step 11's layout, (ep_size, copies): groups of `--ep-size` ranks hold the experts, an equal share each
    (group_layout), and world size / ep_size copies of them exist. Every rank trains on its own share of each
    batch. Input that does not fit is one UsageError."""
    if args.top_k > args.experts:
        raise UsageError(f"--top-k {args.top_k} is more than the {args.experts} experts")
    require_divisible_batch(args.batch_size, world_size)
    return group_layout(args, world_size, "--ep-size", args.ep_size, args.experts, "experts")


def group_layout(args, world_size, flag, size, parts, unit):
    """(size, replicas) for the vision transformer's steps: groups of `size` ranks (default 2, or 1 alone), each
    rank with an equal share of the model's `parts` `unit`, and world size / size replicas of the group (in 09 and
    10 they split each batch). Input that does not fit is one UsageError."""
    size = size or min(2, world_size)
    if world_size % size or parts % size:
        raise UsageError(f"{flag} {size} must divide the world size {world_size} and the {parts} {unit}")
    if args.width % models.VIT_HEADS:
        raise UsageError(f"--width {args.width} is not divisible by the {models.VIT_HEADS} heads")
    replicas = world_size // size
    if args.batch_size % replicas:  # --batch-size is global: each replica takes an equal share
        raise UsageError(f"--batch-size {args.batch_size} is not divisible by {replicas} replica(s)")
    return size, replicas


def smoothing_term(logits, labels):
    """Step 09's label smoothing under `loss_parallel`, which takes none: ε times this is what
    --label-smoothing adds to each sample's loss, mean(-log p) - nll, which is the label's logit minus
    the mean logit (log p = logit - logsumexp, logsumexp = nll + the label's logit). One sum over the
    classes, which each rank of the tensor-parallel group takes over its own logits and DTensor
    all-reduces."""
    from torch.distributed.tensor import distribute_tensor  # DTensor: only 09 needs it

    classes = logits.shape[-1]
    # src_data_rank=None: every rank has the labels, none sends them.
    one_hot = distribute_tensor(F.one_hot(labels, classes).to(logits.dtype), logits.device_mesh, logits.placements,
                                src_data_rank=None)
    return (logits * (one_hot - 1 / classes)).sum(-1)


class Preemption:
    """SIGTERM or SIGUSR1 (a preemption, a scheduler's warning before a time limit) asks the run to stop.

    The signal only sets a flag: the step in flight finishes. At every step boundary each rank calls
    `should_stop()`, which starts one all-reduce (MAX) of its flag and reads the one it started at the step
    before: every rank learns at the same step whether any rank was signalled, one step after it was. They
    then all save the step's checkpoint and stop there together. A rank that stopped on its own flag would
    leave the others waiting in their next collective until the timeout. Read a step late, the all-reduce
    runs while the step computes, and no rank waits for it (a ring of N ranks takes 2(N - 1) hops in turn).

    The all-reduce runs on a gloo group of its own, on a CPU tensor: on GPUs, reading a result of the
    training group (NCCL) every step would make the CPU wait for the GPU at every step. `connect()` creates
    that group right after the process group, so that a network that gloo cannot use (GLOO_SOCKET_IFNAME,
    docs/multi-node.md) fails the job at its start, not at its first step. Its timeout is the steps' 5
    minutes (a new group's default is 30): a rank that died ends the others soon. A single process without a
    process group (06 under plain `python`) has its own flag alone.

    The data loader's worker processes receive the same signals: torchrun signals each worker's whole process
    group, Slurm every process of a job step. PyTorch gives a loader worker a handler that dies of SIGTERM
    unless its parent sent it (a spawned worker dies of SIGUSR1 too), and the trainer then raises "DataLoader
    worker (pid ...) is killed by signal: Terminated" in the middle of a step, before it can save. So the stop
    signals are blocked in this thread from here on, and every thread and process it starts inherits the
    block: the loader's workers never act on them, from their first instruction. One thread of this process
    waits for them (`sigwait`) and sets the flag (docs/fault-tolerance.md says what else that changes)."""

    STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    _latest = None  # the instance that the waiting thread reports to (a second run in one process: the new one)

    def __init__(self):
        self.signal = None  # the first signal received
        self.stopped = False  # the ranks agreed to stop
        self._group = None
        self._sent = None  # (the all-reduce in flight, its flag)
        # This run's from here on, before any signal can reach it: the waiting thread may take one at any time.
        first, Preemption._latest = Preemption._latest is None, self
        utils.STOP_REQUESTED.clear()  # a signal to an earlier run in this process is not this run's
        utils.STOP_SIGNAL["name"] = None
        utils.CATCHING_STOP_SIGNALS.set()  # utils.run ends the process with os._exit (its docstring says why)
        for number in self.STOP_SIGNALS:  # for a thread that started before the block below (imports start some)
            signal.signal(number, self._handle)
        # Processes started by spawn or forkserver (Python 3.14's default on Linux) need multiprocessing's resource
        # tracker, which unblocks SIGTERM in the thread that starts it: started before SIGTERM's block. It ignores
        # SIGTERM itself, and keeps the block of SIGUSR1 that it inherits: no stop signal ends it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        resource_tracker.ensure_running()
        signal.pthread_sigmask(signal.SIG_BLOCK, self.STOP_SIGNALS)
        if first:
            threading.Thread(target=Preemption._wait, name="preemption", daemon=True).start()

    def _handle(self, number, frame=None):
        self.signal = self.signal or signal.Signals(number).name
        utils.STOP_SIGNAL["name"] = self.signal
        utils.STOP_REQUESTED.set()

    @staticmethod
    def _wait():
        while True:
            number = signal.sigwait(Preemption.STOP_SIGNALS)
            Preemption._latest._handle(number)

    def connect(self):
        """Create the flag's gloo group: every rank, right after the process group (which may not exist: then
        this process decides alone)."""
        if dist.is_initialized():
            self._group = dist.new_group(backend="gloo", timeout=TIMEOUT)

    def should_stop(self):
        """True on every rank at the same step if any rank had been signalled by the step before. Every rank
        must call it, at every step."""
        flag = torch.tensor([self.signal is not None], dtype=torch.int32)
        if self._group is None:
            if dist.is_initialized():
                raise RuntimeError("distributed.connect_stop_flag() must follow init_process_group on every rank")
            self.stopped = bool(flag.item())
            return self.stopped
        if self._sent is not None:
            work, sent_flag = self._sent
            work.wait()
            self.stopped = bool(sent_flag.item())
        self._sent = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag
        return self.stopped


def catch_stop_signals():
    """From here on, SIGTERM and SIGUSR1 ask the run to stop at a step that every rank agrees on
    (`Preemption`). In `main()` once the flags are parsed, before `setup()`: until then, either signal
    ends the process."""
    Preemption()


def connect_stop_flag():
    """Create the stop flag's gloo group: every rank, right after `init_process_group`, so that a network
    that gloo cannot use fails the job here, at its start."""
    _caught().connect()


def should_stop():
    """True on every rank at the same step once any rank was asked to stop: the run saves a checkpoint
    there and raises `utils.Preempted`. Every rank must call it, after every optimizer step."""
    return _caught().should_stop()


def _caught():
    if Preemption._latest is None:
        raise RuntimeError("call distributed.catch_stop_signals() first, in main()")
    return Preemption._latest


def remove_deepspeed_shared_memory():
    """DeepSpeed 0.19's CPU communication op, under the deepspeed launcher on one machine (LOCAL_SIZE is the world
    size), maps a buffer of 69 MB per rank in /dev/shm, which is memory, and never removes it: each run would
    leave one per rank until the machine restarts. Every rank calls this after `deepspeed.initialize`: past the
    barrier every rank has mapped every buffer, and each removes its own name (the memory goes with the
    processes). Elsewhere there is nothing to remove."""
    dist.barrier()
    name = (f"deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
            f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}")
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join("/dev/shm", name))
