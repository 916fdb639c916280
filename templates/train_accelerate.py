"""Accelerate template: copy it, replace build_model() and build_datasets(), keep the rest.

One `Accelerator` does the set-up under any launcher; `prepare` wraps model and optimizer (DDP) and
shards the loaders; `backward`, `gather_for_metrics` and `save_state` do the rest. The tour's step 06
(06_mnist_accelerate.py) explains each idea, docs/templates.md what to change.

    torchrun --standalone --nproc_per_node=2 templates/train_accelerate.py   # 2 processes: CPUs (gloo) or GPUs
    accelerate launch --multi_gpu --num_processes N templates/train_accelerate.py   # N GPUs, its launcher
Each epoch ends with a checkpoint; a run with the same --output-dir and number of processes continues from it.
"""

import argparse
import datetime
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96, help="global: all processes together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--output-dir", default="runs/template_accelerate")
    return parser.parse_args()


def build_model():  # YOUR MODEL
    return nn.Sequential(nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)),
                         nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU()),
                         nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10)))


def build_datasets():  # YOUR DATA: a training and a test set of (input, label) pairs, the same on every rank
    # Stand-in images: 10 classes, each a smooth colour pattern under noise. 1,001 test samples: unequal slices.
    generator = torch.Generator().manual_seed(0)
    patterns = F.interpolate(torch.randn(10, 3, 4, 4, generator=generator), size=(16, 16), mode="bilinear")

    def make(count):
        labels = torch.randint(10, (count,), generator=generator)
        return TensorDataset(patterns[labels] + 3 * torch.randn(count, 3, 16, 16, generator=generator), labels)

    return make(3072), make(1001)


def main():
    args = parse_args()
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))  # from the launcher
    if args.batch_size % world_size:  # every rank exits (rank 0 says why) before any waits for the others
        sys.exit(f"error: --batch-size {args.batch_size} is not divisible by {world_size}" if rank == 0 else 2)
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # without it, CPU processes under torchrun would each train alone
        # --batch-size is global: `prepare` splits each batch. The seedable sampler shuffles by (seed, epoch).
        dataloader_config=DataLoaderConfiguration(split_batches=True, use_seedable_sampler=True, data_seed=0),
        # A short timeout: a job whose rank died fails in minutes instead of after the default 30.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=5))],
    )
    if accelerator.num_processes != world_size:  # N processes that each trained alone would look fine
        sys.exit(f"error: {world_size} processes, but Accelerate sees {accelerator.num_processes}" if rank == 0 else 2)
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    train_set, test_set = build_datasets()
    # Plain loaders: `prepare` shards them. The test loader's last batch is padded for an even split;
    # gather_for_metrics drops the padding again.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True)
    test_loader = DataLoader(test_set, batch_size=args.batch_size)  # split too: divisible by the processes

    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    # Moves the model to the device and wraps it (DDP across processes), the optimizer and the loaders.
    model, optimizer, train_loader, test_loader = accelerator.prepare(model, optimizer, train_loader, test_loader)

    checkpoints = Path(args.output_dir, "checkpoints")
    start_epoch = 0
    if (checkpoints / "latest").is_file():  # a rerun, or torchrun --max-restarts: continue
        start_epoch = int((checkpoints / "latest").read_text()) + 1  # after the last complete epoch
        accelerator.load_state(checkpoints / f"epoch{start_epoch - 1}")

    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # the prepared loader's: without it, every epoch repeats one order
        model.train()
        loss_sum = torch.zeros(2, device=accelerator.device)  # loss sum, batches
        for inputs, labels in train_loader:  # already on the device
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            accelerator.backward(loss)  # instead of loss.backward(): scales the loss under fp16
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=accelerator.device)])
        loss_sum = accelerator.reduce(loss_sum)  # every rank calls it: a collective that one rank skips hangs
        if not loss_sum.isfinite().all():  # the same sum on every rank: all stop, before saving NaN weights
            sys.exit(f"error: the loss diverged in epoch {epoch + 1}: lower --lr" if rank == 0 else 2)
        # Every process: the main one writes the model and optimizer, each its own random state.
        accelerator.save_state(checkpoints / f"epoch{epoch}")
        accelerator.wait_for_everyone()  # every file complete before `latest` names the checkpoint
        if accelerator.is_main_process:  # no collective in here: the other ranks would never join it
            print(f"epoch {epoch + 1}/{args.epochs}  train_loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            # `latest` last, through a temporary file: a crash mid-save leaves it naming a complete checkpoint.
            (checkpoints / "latest.tmp").write_text(str(epoch))
            os.replace(checkpoints / "latest.tmp", checkpoints / "latest")

    metrics = {"world_size": world_size, "epochs": args.epochs, **evaluate(model, test_loader, accelerator)}
    if accelerator.is_main_process:
        print(json.dumps(metrics), flush=True)
        # unwrap_model takes the wrappers off: a plain state_dict, without "module." prefixes.
        torch.save(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
        Path(args.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    accelerator.wait_for_everyone()  # leave together: the main process may still be writing
    # Free what holds the process group first: its gloo threads would outlive it and abort Python's shutdown.
    del model, optimizer, train_loader, test_loader
    gc.collect()
    accelerator.end_training()  # destroys the process group


@torch.no_grad()
def evaluate(model, loader, accelerator):  # over the whole test set, the same on every process
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # loss sum, correct, samples
    for inputs, labels in loader:
        logits = model(inputs)  # DDP's forward gives every rank rank 0's BatchNorm statistics first
        # Every process's results, less the samples repeated to pad the last batch: each counted once.
        logits, labels = accelerator.gather_for_metrics((logits, labels))
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum(), labels.new_tensor(len(labels))]).to(totals)
    loss_sum, correct, samples = totals.tolist()
    return {"test_loss": loss_sum / samples, "test_accuracy": correct / samples, "test_samples": int(samples)}


if __name__ == "__main__":
    main()
