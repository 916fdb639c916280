"""DeepSpeed template: copy it, change the places marked YOUR (model, data, batch, optimizer), keep the rest.

`deepspeed.initialize` wraps model and optimizer in an engine that averages the gradients and partitions the
optimizer state and gradients (ZeRO-2, in the config below); the loop calls the engine. Step 05
(05_cifar10_deepspeed.py) explains each idea, docs/templates.md what to change.

    torchrun --standalone --nproc_per_node=2 templates/train_deepspeed.py    # 2 processes: CPUs (gloo) or GPUs
    deepspeed --num_gpus=N templates/train_deepspeed.py --epochs 20          # N GPUs, DeepSpeed's launcher
    python templates/train_deepspeed.py                                      # one process
Checkpoints go to runs/<this file's name>/checkpoints at each epoch's end; the same command run again continues
from the newest, at the same number of processes (ZeRO's shards). SIGTERM (preemption) stops every rank at one
step, saved there: exit status 75. So does SIGUSR1 (a time limit near), which torchrun passes on only if told:
    torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=90 ...   # 90 s to save
"""

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Mapping
from multiprocessing import resource_tracker
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption, a scheduler's time limit near
# How srun and the MPIs number the processes they start (size, rank): not as torchrun does.
STARTED_BY = (("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"), ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
              ("PMI_SIZE", "PMI_RANK"), ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"))


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96, help="global: all processes together")
    parser.add_argument("--lr", type=float, default=0.05, help="the schedule's peak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=2, help="data-loader processes per rank")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept, the newest")
    parser.add_argument("--output-dir", default=os.path.join("runs", Path(__file__).stem))
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher; unused
    return parser.parse_args()


def build_model():  # YOUR MODEL
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)),
                         nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)))


def build_datasets():  # YOUR DATA: a training and a test set, the same on every rank
    # Stand-in images: 10 classes, each a smooth colour pattern under noise. 1,001 test samples: unequal slices.
    generator = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=generator), size=(16, 16), mode="bilinear")
    labels = torch.randint(10, (4073,), generator=generator)
    images = patterns[labels] + 3 * torch.randn(4073, 3, 16, 16, generator=generator)
    return TensorDataset(images[:3072], labels[:3072]), TensorDataset(images[3072:], labels[3072:])


def forward(model, batch):  # YOUR BATCH, as your data set's samples make it: returns the logits and the labels
    inputs, labels = batch
    return model(inputs), labels


def build_optimizer(model, args, total_steps):  # YOUR OPTIMIZER (--lr's default suits this SGD; AdamW: about 1e-3)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    return optimizer, torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total_steps)


def main():
    args = parse_args()
    signalled = []  # a stop signal sets it; every step, the ranks agree on it (below): none stops alone
    for number in STOP_SIGNALS:  # (a thread that an import started may be the one that receives it)
        signal.signal(number, lambda number, frame: signalled.append(number))
    # torchrun and Slurm signal the data loader's workers too, which die of it mid-step. Blocked here, before any
    # starts, the signals stay blocked in them; one thread waits for them. Spawned workers need multiprocessing's
    # resource tracker, which unblocks SIGTERM where it starts (so it starts first) and dies of an unblocked SIGUSR1.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(target=lambda: signalled.append(signal.sigwait(STOP_SIGNALS)), daemon=True).start()
    if "RANK" not in os.environ:  # plain `python`: a world of one (the launchers set these for each process)
        for size, rank_name in STARTED_BY:  # several: each would train alone, and all write the same files
            if int(os.environ.get(size, 1)) > 1:
                sys.exit(f"error: {os.environ[size]} processes without RANK and WORLD_SIZE: start them with "
                         "torchrun" if os.environ.get(rank_name) == "0" else 2)
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    # Each process's rank among all, its GPU on this machine, how many in all.
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    problem = (f"--batch-size {args.batch_size} is not divisible by {world_size}" if args.batch_size % world_size
               else f"--keep {args.keep}: keep at least 1" if args.keep < 1 else None)
    if problem:  # every rank exits (rank 0 says why) before any waits for the others
        sys.exit(f"error: {problem}" if rank == 0 else 2)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every process would use GPU 0
    # A short timeout: a job whose rank died fails in minutes instead of after gloo's 30 (NCCL's 10).
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),
                            device_id=device if device.type == "cuda" else None)  # NCCL: bound to this GPU
    # The stop flag's all-reduce: on the CPU (no GPU sync per step), with the same short timeout (a new group's is 30).
    stop_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(args.seed)  # the same initial weights everywhere (the engine also broadcasts rank 0's)
    train_set, test_set = build_datasets()
    # Each rank keeps every world_size-th sample of one shuffle that every rank draws alike: disjoint shares.
    sampler = DistributedSampler(train_set, world_size, rank, shuffle=True, seed=args.seed, drop_last=True)
    # Spawned workers, once per run: one forked while a gloo or NCCL thread holds a lock of Python's can hang for ever.
    # Each imports this file and unpickles the data set: define its class at the top level of a module.
    train_loader = DataLoader(train_set, args.batch_size // world_size, sampler=sampler, drop_last=True,
                              num_workers=args.num_workers, pin_memory=device.type == "cuda",
                              multiprocessing_context="spawn" if args.num_workers else None,
                              persistent_workers=args.num_workers > 0)
    # Test: a disjoint slice per rank (DistributedSampler pads), as many batches on each: ZeRO-3 forwards gather.
    test_slice = range(rank, len(test_set), world_size)
    batches = torch.arange(len(test_slice)).tensor_split(math.ceil(math.ceil(len(test_set) / world_size) / 256))
    test_loader = DataLoader(Subset(test_set, test_slice), batch_sampler=[batch.tolist() for batch in batches])

    model = build_model()
    # What a checkpoint must come from to be continued here: ZeRO's shards are one per process.
    run = {"--batch-size": args.batch_size, "--epochs": args.epochs, "--lr": args.lr, "--seed": args.seed,
           "processes": world_size, "training samples": len(train_set),
           "parameters": {k: list(v.shape) for k, v in model.named_parameters()}}
    checkpoints, total_steps = Path(args.output_dir, "checkpoints"), args.epochs * len(train_loader)
    latest = latest_checkpoint(checkpoints, run, total_steps, rank)
    if latest and latest["finished"]:  # exits 0, its outputs left as they are
        dist.destroy_process_group()
        return 0
    if rank == 0:  # an earlier run's outputs: "finished" means this run wrote them
        Path(args.output_dir, "metrics.json").unlink(missing_ok=True)
    model = model.to(device)
    optimizer, scheduler = build_optimizer(model, args, total_steps)
    config = {  # DeepSpeed's settings (a ds_config.json file elsewhere); the batch sizes must agree
        "train_batch_size": args.batch_size,  # global: micro-batch x gradient accumulation x world size
        "train_micro_batch_size_per_gpu": args.batch_size // world_size,
        "zero_optimization": {"stage": 2},  # 1: optimizer state partitioned, 2: and gradients, 3: and weights
        "zero_allow_untested_optimizer": True,  # a torch optimizer under ZeRO
        "torch_autocast": {"enabled": False, "dtype": "bf16"},  # True on bf16 GPUs (a "bf16" section casts BatchNorm)
    }
    # The engine broadcasts rank 0's weights, wraps the optimizer for ZeRO, averages the gradients and steps the
    # schedule; its checkpoints hold all three.
    model, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                                          config=config)
    # Under the deepspeed launcher on one machine, DeepSpeed's CPU communication op maps 69 MB per rank in /dev/shm
    # and never removes it. Past the barrier every rank has mapped them all: each removes its own name.
    dist.barrier()
    with contextlib.suppress(FileNotFoundError):
        os.remove(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_"
                  f"{os.environ.get('MASTER_PORT', '')}_{rank}")
    step = latest["step"] if latest else 0  # optimizer steps done, all epochs together
    if latest:  # a rerun, or torchrun --max-restarts: continue where the last run stopped
        model.load_checkpoint(checkpoints, tag=latest["name"])  # each rank reads its shard

    stop = torch.tensor(0)  # becomes 1 on every rank at the same step once any rank was signalled
    for epoch in range(step // len(train_loader), args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats the first one's order
        model.train()
        loss_sum = torch.zeros(2, device=device)  # loss sum, batches
        for batch_index, batch in enumerate(train_loader):
            if epoch * len(train_loader) + batch_index < step:  # trained before the run was stopped: read, skipped
                continue
            logits, labels = forward(model, to_device(batch, device))
            loss = F.cross_entropy(logits, labels)
            model.backward(loss)  # instead of loss.backward(): the engine averages the gradients
            model.step()  # instead of optimizer.step(), scheduler.step() and zero_grad()
            step += 1
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            stop = torch.tensor(int(bool(signalled)))  # every rank, every step: one rank alone would hang the rest
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=stop_group)
            if stop:
                break
        dist.all_reduce(loss_sum)  # every rank calls it: a collective that one rank skips hangs the others
        if not loss_sum.isfinite().all():  # the same sum on every rank: all stop, before saving NaN weights
            sys.exit(f"error: the loss diverged in epoch {epoch + 1}: lower --lr" if rank == 0 else 2)
        # Every rank must call it: each writes its own shard, with barriers inside (never in `if rank == 0`).
        model.save_checkpoint(checkpoints, tag=f"step{step}", save_latest=False)
        if rank == 0:  # no collective in here: the other ranks would never join it
            print(f"epoch {epoch + 1}/{args.epochs}  train_loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's converters, copied at every save
                (checkpoints / script).unlink(missing_ok=True)
            saved(checkpoints, {"name": f"step{step}", "epoch": epoch + 1, "step": step, "run": run}, args.keep)
        if stop:
            break
    stop = bool(stop) and step < total_steps  # a signal in the last step: finished anyway

    if stop and rank == 0:
        print(f"preempted: stopped in epoch {epoch + 1}, saved; run again to continue", file=sys.stderr)
    elif not stop:  # finished
        metrics = {"world_size": world_size, "epochs": args.epochs, **evaluate(model, test_loader, device)}
        if rank == 0:
            print(json.dumps(metrics), flush=True)
            # Whole fp32 weights at any ZeRO stage (under ZeRO-3 only shards exist): from the last checkpoint.
            weights = get_fp32_state_dict_from_zero_checkpoint(checkpoints, tag=f"step{step}")
            torch.save(weights, os.path.join(args.output_dir, "model.pt"))
            Path(args.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    dist.barrier()  # leave together: rank 0 may still be writing
    # Free what holds the process group first: its gloo threads would outlive it and abort Python's shutdown.
    del model, optimizer, scheduler
    gc.collect()
    dist.destroy_process_group()
    return 75 if stop else 0  # 75 (EX_TEMPFAIL): stopped early and saved; run again to continue


@torch.no_grad()
def evaluate(model, loader, device):  # over the whole test set: each rank's slice, summed
    # DeepSpeed never synchronises buffers: evaluate with rank 0's BatchNorm statistics everywhere.
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for batch in loader:
        logits, labels = forward(model, to_device(batch, device))
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum(), labels.new_tensor(len(labels))]).to(totals)
    dist.all_reduce(totals)  # the sum over the ranks' disjoint slices: each test sample counted once
    loss_sum, correct, samples = totals.tolist()
    return {"test_loss": loss_sum / samples, "test_accuracy": correct / samples, "test_samples": int(samples)}


def to_device(batch, device):  # every tensor of a batch, in tuples, lists and dicts (the structure is YOUR DATA's)
    if isinstance(batch, Mapping):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        moved = [to_device(value, device) for value in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else moved  # a namedtuple keeps its names
    return batch.to(device, non_blocking=True) if hasattr(batch, "to") else batch


def latest_checkpoint(checkpoints, run, total_steps, rank):
    """The checkpoint to continue from, or None, as every rank sees it (one that started over alone would mis-pair
    the collectives): ranks that see different files, or another run's checkpoint, stop every rank, one line."""
    pointer = checkpoints / "latest.json"
    latest = json.loads(pointer.read_text()) if pointer.is_file() else None
    if latest:  # finished: trained to the end, and its outputs written
        latest["finished"] = latest["step"] == total_steps and (checkpoints.parent / "metrics.json").is_file()
    views = [None] * dist.get_world_size()
    dist.all_gather_object(views, latest)
    if differ := [str(other) for other, view in enumerate(views) if view != views[0]]:
        sys.exit(f"error: rank(s) {', '.join(differ)} see other files than rank 0 in {checkpoints}: put --output-dir "
                 "on a file system that every machine shares" if rank == 0 else 2)
    if latest is None:  # and on every rank: they all see the same
        return None
    path, written = checkpoints / latest["name"], latest["run"]
    for setting, value in run.items():
        if written.get(setting) != value:
            what = "another model" if setting == "parameters" else f"{setting} {written.get(setting)}, this run {value}"
            sys.exit(f"error: {path} was written with {what}: use the same or another --output-dir" if rank == 0 else 2)
    if rank == 0:
        print(f"nothing to train: {path} holds epoch {latest['epoch']} of {run['--epochs']}" if latest["finished"]
              else f"resumed from {path}: epoch {latest['epoch']}, step {latest['step']}", flush=True)
    return latest


def saved(checkpoints, latest, keep):  # rank 0, once it is complete: a crash mid-save leaves latest.json naming the old
    (checkpoints / "latest.tmp").write_text(json.dumps(latest))
    os.replace(checkpoints / "latest.tmp", checkpoints / "latest.json")
    found = {int(match[1]): checkpoints / match[0] for path in checkpoints.iterdir()
             if (match := re.fullmatch(r"step(\d+)(\.pt)?", path.name))}
    kept = sorted(step for step in found if step <= latest["step"])[-keep:]
    for path in [path for step, path in found.items() if step not in kept]:  # older, or a crashed run's later
        shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # its traceback keeps the loader's workers alive, and they ignore SIGTERM: Python's exit
        traceback.print_exc()  # would wait for them forever, so end here (skipping atexit handlers)
        sys.stderr.flush()
        os._exit(1)
