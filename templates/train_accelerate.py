"""Accelerate template: copy it, change the places marked YOUR (model, data, batch, optimizer), keep the rest.

One `Accelerator` does the set-up under any launcher; `prepare` wraps model and optimizer (DDP) and shards the
loaders; `backward`, `gather_for_metrics` and `save_state` do the rest. Step 06 (06_mnist_accelerate.py)
explains each idea, docs/templates.md what to change.

    torchrun --standalone --nproc_per_node=2 templates/train_accelerate.py   # 2 processes: CPUs (gloo) or GPUs
    accelerate launch --multi_gpu --num_processes N templates/train_accelerate.py   # N GPUs, its launcher
    python templates/train_accelerate.py                                     # one process
Checkpoints go to runs/<this file's name>/checkpoints at each epoch's end; the same command run again continues
from the newest, at the same number of processes (one random state each). SIGTERM (preemption) stops every
process at one step, saved there: exit status 75. So does SIGUSR1 (a time limit near), which torchrun passes on
only if told:
    torchrun --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout=90 ...   # 90 s to save
"""

import argparse
import datetime
import gc
import json
import os
import re
import shutil
import signal
import sys
import threading
import traceback
from multiprocessing import resource_tracker
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, gather_object, get_int_from_env
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # preemption, a scheduler's time limit near


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96, help="global: all processes together")
    parser.add_argument("--lr", type=float, default=0.05, help="the schedule's peak")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-workers", type=int, default=2, help="data-loader processes per rank")
    parser.add_argument("--keep", type=int, default=2, help="checkpoints kept, the newest")
    parser.add_argument("--output-dir", default=os.path.join("runs", Path(__file__).stem))
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
    signalled = []  # a stop signal sets it; every step, the processes agree on it (below): none stops alone
    for number in STOP_SIGNALS:  # (a thread that an import started may be the one that receives it)
        signal.signal(number, lambda number, frame: signalled.append(number))
    # torchrun and Slurm signal the data loader's workers too, which die of it mid-step. Blocked here, before any
    # starts, the signals stay blocked in them; one thread waits for them. Spawned workers need multiprocessing's
    # resource tracker, which unblocks SIGTERM where it starts (so it starts first) and dies of an unblocked SIGUSR1.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    threading.Thread(target=lambda: signalled.append(signal.sigwait(STOP_SIGNALS)), daemon=True).start()
    # The launcher's numbers: torchrun's, or mpirun's (Accelerate reads these on CPUs only).
    rank = get_int_from_env(["RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK"], 0)
    world_size = get_int_from_env(["WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE"], 1)
    # `accelerate launch --num_processes N` without GPUs or mpirun starts one process, with only a master's port
    # (or the caller's); srun starts N, each alone. Either way N processes would look like one.
    started_alone = "ACCELERATE_USE_CPU" in os.environ and "MASTER_PORT" in os.environ and world_size == 1
    srun_tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS", 1)) if world_size == 1 else 1
    problems = {  # message: whether it holds; the first that holds is reported
        "accelerate launch started one process, not --num_processes (on CPUs, several need mpirun): use "
        "torchrun --nproc_per_node=N (or unset MASTER_PORT)": started_alone,
        f"srun started {srun_tasks} processes, each alone: start them with torchrun": srun_tasks > 1,
        f"--batch-size {args.batch_size} is not divisible by {world_size}": args.batch_size % world_size,
        f"--keep {args.keep}: keep at least 1": args.keep < 1,
    }
    problem = next((message for message, holds in problems.items() if holds), None)
    if problem:  # every process exits (rank 0 says why) before any waits for the others
        sys.exit(f"error: {problem}" if rank == 0 and os.environ.get("SLURM_PROCID", "0") == "0" else 2)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, CPU processes under torchrun would each train alone
        # --batch-size is global: `prepare` splits each batch. The seedable sampler shuffles by (seed, epoch).
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=args.seed),
        # A short timeout: a job whose rank died fails in minutes, not after gloo's 30 (NCCL's 10). (A model with
        # parameters that some steps leave unused: add DistributedDataParallelKwargs(find_unused_parameters=True).)
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=5))],
    )
    if accelerator.num_processes != world_size:  # N processes that each trained alone would look fine
        sys.exit(f"error: {world_size} processes, but Accelerate sees {accelerator.num_processes}" if rank == 0 else 2)
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    train_set, test_set = build_datasets()
    # Plain loaders: `prepare` shards them. The test loader's last batch is padded for an even split;
    # gather_for_metrics drops the padding again.
    # Spawned workers, once per run: one forked while a gloo or NCCL thread holds a lock of Python's can hang for ever.
    # Each imports this file and unpickles the data set: define its class at the top level of a module.
    train_loader = DataLoader(train_set, args.batch_size, shuffle=True, drop_last=True, num_workers=args.num_workers,
                              multiprocessing_context="spawn" if args.num_workers else None,
                              persistent_workers=args.num_workers > 0)
    test_loader = DataLoader(test_set, args.batch_size)  # split too: divisible by the processes

    model = build_model()
    # What a checkpoint must come from to be continued here: it holds one random state per process.
    run = {"--batch-size": args.batch_size, "--epochs": args.epochs, "--lr": args.lr, "--seed": args.seed,
           "processes": world_size, "training samples": len(train_set),
           "parameters": {k: list(v.shape) for k, v in model.named_parameters()}}
    checkpoints, total_steps = Path(args.output_dir, "checkpoints"), args.epochs * len(train_loader)
    latest = latest_checkpoint(checkpoints, run, total_steps, rank)
    if latest and latest["finished"]:  # exits 0, its outputs left as they are
        accelerator.end_training()
        return 0
    if accelerator.is_main_process:  # an earlier run's outputs: "finished" means this run wrote them
        Path(args.output_dir, "metrics.json").unlink(missing_ok=True)
    optimizer, scheduler = build_optimizer(model, args, total_steps)
    # Moves the model to the device and wraps it (DDP across processes), the optimizer, schedule and loaders.
    model, optimizer, scheduler, train_loader, test_loader = accelerator.prepare(
        model, optimizer, scheduler, train_loader, test_loader)
    step = latest["step"] if latest else 0  # optimizer steps done, all epochs together
    if latest:  # a rerun, or torchrun --max-restarts: continue where the last run stopped
        accelerator.load_state(checkpoints / latest["name"])  # everything prepared, and the random states

    stop = False  # becomes True on every process at the same step once any process was signalled
    for epoch in range(step // len(train_loader), args.epochs):
        train_loader.set_epoch(epoch)  # the prepared loader counts epochs itself, but a resumed run from 0
        model.train()
        loss_sum = torch.zeros(2, device=accelerator.device)  # loss sum, batches
        # Trained before the run was stopped: skipped, without reading them.
        done = step - epoch * len(train_loader)
        for batch in accelerator.skip_first_batches(train_loader, done) if done > 0 else train_loader:
            logits, labels = forward(model, batch)  # the batch is on the device already
            loss = F.cross_entropy(logits, labels)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)  # instead of loss.backward(): scales the loss under fp16
            optimizer.step()
            scheduler.step()
            step += 1
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=accelerator.device)])
            if signalled:
                accelerator.set_trigger()
            stop = accelerator.check_trigger()  # every process, every step: one alone would hang the rest
            if stop:
                break
        loss_sum = accelerator.reduce(loss_sum)  # every rank calls it: a collective that one rank skips hangs
        if not loss_sum.isfinite().all():  # the same sum on every rank: all stop, before saving NaN weights
            sys.exit(f"error: the loss diverged in epoch {epoch + 1}: lower --lr" if rank == 0 else 2)
        # Every process: the main one writes the model, optimizer and schedule, each its own random state.
        accelerator.save_state(checkpoints / f"step{step}")
        accelerator.wait_for_everyone()  # every file complete before `latest.json` names the checkpoint
        if accelerator.is_main_process:  # no collective in here: the other ranks would never join it
            print(f"epoch {epoch + 1}/{args.epochs}  train_loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            saved(checkpoints, {"name": f"step{step}", "epoch": epoch + 1, "step": step, "run": run}, args.keep)
        if stop:
            break
    stop = bool(stop) and step < total_steps  # a signal in the last step: finished anyway

    if stop and accelerator.is_main_process:
        print(f"preempted: stopped in epoch {epoch + 1}, saved; run again to continue", file=sys.stderr)
    elif not stop:  # finished
        metrics = {"world_size": world_size, "epochs": args.epochs, **evaluate(model, test_loader, accelerator)}
        if accelerator.is_main_process:
            print(json.dumps(metrics), flush=True)
            # unwrap_model takes the wrappers off: a plain state_dict, without "module." prefixes.
            torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
            Path(args.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    accelerator.wait_for_everyone()  # leave together: the main process may still be writing
    # Free what holds the process group first: its gloo threads would outlive it and abort Python's shutdown.
    del model, optimizer, scheduler, train_loader, test_loader
    gc.collect()
    accelerator.end_training()  # destroys the process group
    return 75 if stop else 0  # 75 (EX_TEMPFAIL): stopped early and saved; run again to continue


@torch.no_grad()
def evaluate(model, loader, accelerator):  # over the whole test set, the same on every process
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, correct, samples
    for batch in loader:
        logits, labels = forward(model, batch)  # DDP's forward gives every rank rank 0's BatchNorm statistics first
        # Every process's results, less the samples repeated to pad the last batch: each counted once.
        logits, labels = accelerator.gather_for_metrics((logits, labels))
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum(), labels.new_tensor(len(labels))]).to(totals)
    loss_sum, correct, samples = totals.tolist()
    return {"test_loss": loss_sum / samples, "test_accuracy": correct / samples, "test_samples": int(samples)}


def latest_checkpoint(checkpoints, run, total_steps, rank):
    """The checkpoint to continue from, or None, as every rank sees it (one that started over alone would mis-pair
    the collectives): ranks that see different files, or another run's checkpoint, stop every rank, one line."""
    pointer = checkpoints / "latest.json"
    latest = json.loads(pointer.read_text()) if pointer.is_file() else None
    if latest:  # finished: trained to the end, and its outputs written
        latest["finished"] = latest["step"] == total_steps and (checkpoints.parent / "metrics.json").is_file()
    views = gather_object([latest])  # every process's, in rank order
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
