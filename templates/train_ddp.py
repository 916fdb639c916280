"""DDP template: copy it, replace build_model() and build_datasets(), keep the rest.

One process per GPU (or per CPU share), each on its own share of every batch; DistributedDataParallel
averages the gradients, so the replicas stay identical. PyTorch only; the tour's step 04
(04_cifar10_ddp.py) explains each idea, docs/templates.md what to change.

    torchrun --standalone --nproc_per_node=2 templates/train_ddp.py     # 2 processes: CPUs (gloo) or GPUs (NCCL)
    torchrun --nproc_per_node=N templates/train_ddp.py --epochs 20      # N GPUs
Each epoch ends with a checkpoint; a run with the same --output-dir continues from it. SIGTERM or SIGUSR1
(preemption) stops every rank at one step, saved there: exit status 75.
"""

import argparse
import datetime
import gc
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96, help="global: all processes together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--output-dir", default="runs/template_ddp")
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
    signalled = []  # SIGTERM, SIGUSR1: a flag, not the default action (death mid-step); the ranks agree below
    for number in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, lambda number, frame: signalled.append(number))
    # torchrun sets these for each process: its rank among all, its GPU on this machine, how many in all.
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if args.batch_size % world_size:  # every rank exits (rank 0 says why) before any waits for the others
        sys.exit(f"error: --batch-size {args.batch_size} is not divisible by {world_size}" if rank == 0 else 2)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every process would use GPU 0
    # A short timeout: a job whose rank died fails in minutes instead of after the default 30.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),
                            device_id=device if device.type == "cuda" else None)  # NCCL: bound to this GPU
    # The stop flag's all-reduce: on the CPU (no GPU sync per step), with the same short timeout (a new group's is 30).
    stop_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=5))
    torch.manual_seed(0)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    train_set, test_set = build_datasets()
    # Each rank keeps every world_size-th sample of one shuffle that every rank draws alike: disjoint shares.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler, drop_last=True)
    # Evaluation: a disjoint slice per rank. DistributedSampler would pad the slices with repeated samples.
    test_loader = DataLoader(Subset(test_set, range(rank, len(test_set), world_size)), batch_size=256)

    model = build_model().to(device)
    # Broadcasts rank 0's weights now; averages the gradients during every backward.
    model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    checkpoint_path = os.path.join(args.output_dir, "checkpoint.pt")
    start_epoch, start_batch = 0, 0
    if os.path.isfile(checkpoint_path):  # a rerun, or torchrun --max-restarts: continue where the last run stopped
        # map_location: tensors saved from cuda:0 would otherwise all land on GPU 0.
        checkpoint = torch.load(checkpoint_path, map_location=device, weights_only=True)
        model.module.load_state_dict(checkpoint["model"])  # the plain module's keys, without "module."
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_epoch, start_batch = divmod(checkpoint["steps"], len(train_loader))  # where the last run stopped

    stop = torch.tensor(0)  # becomes 1 on every rank at the same step once any rank was signalled
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats the first one's order
        model.train()
        loss_sum = torch.zeros(2, device=device)  # loss sum, batches
        for batch, (inputs, labels) in enumerate(train_loader):
            if epoch == start_epoch and batch < start_batch:  # trained before the run was stopped
                continue
            inputs, labels = inputs.to(device), labels.to(device)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP all-reduces the gradients here, bucket by bucket
            optimizer.step()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
            stop = torch.tensor(int(bool(signalled)))  # every rank, every step: one rank alone would hang the rest
            dist.all_reduce(stop, op=dist.ReduceOp.MAX, group=stop_group)
            if stop:
                break
        dist.all_reduce(loss_sum)  # every rank calls it: a collective that one rank skips hangs the others
        if not loss_sum.isfinite().all():  # the same sum on every rank: all stop, before saving NaN weights
            sys.exit(f"error: the loss diverged in epoch {epoch + 1}: lower --lr" if rank == 0 else 2)
        if rank == 0:  # no collective in here: the other ranks would never join it
            print(f"epoch {epoch + 1}/{args.epochs}  train_loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            os.makedirs(args.output_dir, exist_ok=True)
            # Through a temporary file: a crash mid-write leaves the previous checkpoint whole.
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "steps": epoch * len(train_loader) + batch + 1}, checkpoint_path + ".tmp")
            os.replace(checkpoint_path + ".tmp", checkpoint_path)
        if stop:
            break

    if stop and rank == 0:
        print(f"preempted: stopped in epoch {epoch + 1}, saved; run again to continue", file=sys.stderr)
    elif not stop:  # finished
        metrics = {"world_size": world_size, "epochs": args.epochs, **evaluate(model, test_loader, device)}
        if rank == 0:
            print(json.dumps(metrics), flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.output_dir, "model.pt"))
            Path(args.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    dist.barrier()  # leave together: rank 0 may still be writing
    # Free what holds the process group first: its gloo threads would outlive it and abort Python's shutdown.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    return 75 if stop else 0  # 75 (EX_TEMPFAIL): stopped early and saved; run again to continue


@torch.no_grad()
def evaluate(model, loader, device):  # over the whole test set: each rank's slice, summed
    # Rank 0's BatchNorm statistics everywhere (each rank's followed its own batches), and the plain
    # module: DDP's forward could call a collective that a rank with fewer test batches never joins.
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)
        logits = model.module(inputs)
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum(), labels.new_tensor(len(labels))]).to(totals)
    dist.all_reduce(totals)  # the sum over the ranks' disjoint slices: each test sample counted once
    loss_sum, correct, samples = totals.tolist()
    return {"test_loss": loss_sum / samples, "test_accuracy": correct / samples, "test_samples": int(samples)}


if __name__ == "__main__":
    sys.exit(main())
