"""FSDP2 template: copy it, replace build_model() and build_datasets(), keep the rest.

Each rank keeps 1/N of every weight, gradient and optimizer state (`fully_shard`); checkpoints are
sharded too (torch.distributed.checkpoint) and load at any number of processes. PyTorch only; the
tour's step 07 (07_cifar10_fsdp.py) explains each idea, docs/templates.md what to change.

    torchrun --standalone --nproc_per_node=2 templates/train_fsdp.py     # 2 processes: CPUs (gloo) or GPUs (NCCL)
    torchrun --nproc_per_node=N templates/train_fsdp.py --epochs 20      # N GPUs
Each epoch ends with a checkpoint; a run with the same --output-dir continues from it.
"""

import argparse
import datetime
import gc
import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96, help="global: all processes together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--output-dir", default="runs/template_fsdp")
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
    torch.manual_seed(0)  # the initial weights, which rank 0 builds (below)
    train_set, test_set = build_datasets()
    # Each rank keeps every world_size-th sample of one shuffle that every rank draws alike: disjoint shares.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler, drop_last=True)
    # Test: a disjoint slice per rank (DistributedSampler pads), in as many batches on each: forwards gather weights.
    test_slice = range(rank, len(test_set), world_size)
    batches = torch.arange(len(test_slice)).tensor_split(math.ceil(math.ceil(len(test_set) / world_size) / 256))
    test_loader = DataLoader(Subset(test_set, test_slice), batch_sampler=[batch.tolist() for batch in batches])

    # On the meta device: shapes, no memory. Each rank allocates only its shards, so a model larger than a GPU fits.
    with torch.device("meta"):
        model = build_model()
    for block in model:  # one unit per block (in YOUR MODEL: e.g. each transformer layer), inner units first
        fully_shard(block)
    fully_shard(model)  # the root: what is left; each rank will hold 1/N of every weight (DTensors)
    model.to_empty(device=device)  # this rank's shards, not yet initialised
    # The initial weights, built once in rank 0's CPU memory and sent tensor by tensor: each rank keeps its shard
    # of each. Buffers registered with persistent=False are in no state dict: set them after to_empty.
    initial_weights = build_model().state_dict() if rank == 0 else {}
    set_model_state_dict(model, initial_weights,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # after sharding: on the shards

    checkpoints, start_epoch = Path(args.output_dir, "checkpoints"), 0
    if (checkpoints / "latest").is_file():  # a rerun, or torchrun --max-restarts: continue
        epoch = int((checkpoints / "latest").read_text())  # the last complete epoch
        model_state, optimizer_state = get_state_dict(model, optimizer)  # what to fill, sharded as now: any world size
        dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoints / f"epoch{epoch}")
        set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
        start_epoch = epoch + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats the first one's order
        model.train()
        loss_sum = torch.zeros(2, device=device)  # loss sum, batches
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # reduce-scatters the gradients: each rank gets its shard's average
            optimizer.step()  # each rank updates its own shard
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)  # every rank calls it: a collective that one rank skips hangs the others
        if not loss_sum.isfinite().all():  # the same sum on every rank: all stop, before saving NaN weights
            sys.exit(f"error: the loss diverged in epoch {epoch + 1}: lower --lr" if rank == 0 else 2)
        for buffer in model.buffers():  # not sharded, so written once from any rank: make them rank 0's everywhere
            dist.broadcast(buffer, src=0)
        # Every rank writes its own shards, in parallel (a collective: never inside `if rank == 0`).
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=checkpoints / f"epoch{epoch}")
        if rank == 0:  # no collective in here: the other ranks would never join it
            print(f"epoch {epoch + 1}/{args.epochs}  train_loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            # `latest` last, through a temporary file: a crash mid-save leaves it naming a complete checkpoint.
            (checkpoints / "latest.tmp").write_text(str(epoch))
            os.replace(checkpoints / "latest.tmp", checkpoints / "latest")

    metrics = {"world_size": world_size, "epochs": args.epochs, **evaluate(model, test_loader, device)}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole, on rank 0, on the CPU
    state_dict = get_model_state_dict(model, options=options)  # gathers: a collective, so every rank calls it
    if rank == 0:
        print(json.dumps(metrics), flush=True)
        torch.save(state_dict, os.path.join(args.output_dir, "model.pt"))
        Path(args.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    dist.barrier()  # leave together: rank 0 may still be writing
    # Free what holds the process group first: its gloo threads would outlive it and abort Python's shutdown.
    del model, optimizer, model_state, optimizer_state
    gc.collect()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device):  # over the whole test set: each rank's slice, summed
    for buffer in model.buffers():  # rank 0's BatchNorm statistics: each rank's followed its own batches
        dist.broadcast(buffer, src=0)
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)
        logits = model(inputs)
        totals += torch.stack([F.cross_entropy(logits, labels, reduction="sum"),
                               (logits.argmax(1) == labels).sum(), labels.new_tensor(len(labels))]).to(totals)
    dist.all_reduce(totals)  # the sum over the ranks' disjoint slices: each test sample counted once
    loss_sum, correct, samples = totals.tolist()
    return {"test_loss": loss_sum / samples, "test_accuracy": correct / samples, "test_samples": int(samples)}


if __name__ == "__main__":
    main()
