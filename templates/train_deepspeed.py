"""DeepSpeed template: copy it, replace build_model() and build_datasets(), keep the rest.

`deepspeed.initialize` wraps model and optimizer in an engine that averages the gradients and
partitions the optimizer state and gradients (ZeRO-2, in the config below); the loop calls the engine.
The tour's step 05 (05_cifar10_deepspeed.py) explains each idea, docs/templates.md what to change.

    torchrun --standalone --nproc_per_node=2 templates/train_deepspeed.py    # 2 processes: CPUs (gloo) or GPUs
    deepspeed --num_gpus=N templates/train_deepspeed.py --epochs 20          # N GPUs, DeepSpeed's launcher
Each epoch ends with a checkpoint; a run with the same --output-dir and number of processes continues from it.
"""

import argparse
import datetime
import gc
import json
import math
import os
import sys
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96, help="global: all processes together")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--output-dir", default="runs/template_deepspeed")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # from the deepspeed launcher; unused
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
    # torchrun and deepspeed set these for each process: its rank among all, its GPU here, how many in all.
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if args.batch_size % world_size:  # every rank exits (rank 0 says why) before any waits for the others
        sys.exit(f"error: --batch-size {args.batch_size} is not divisible by {world_size}" if rank == 0 else 2)
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before any CUDA work, or every process would use GPU 0
    # A short timeout: a job whose rank died fails in minutes instead of after the default 30.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),
                            device_id=device if device.type == "cuda" else None)  # NCCL: bound to this GPU
    torch.manual_seed(0)  # the same initial weights everywhere (the engine also broadcasts rank 0's)
    train_set, test_set = build_datasets()
    # Each rank keeps every world_size-th sample of one shuffle that every rank draws alike: disjoint shares.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, shuffle=True, seed=0, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size // world_size, sampler=sampler, drop_last=True)
    # Test: a disjoint slice per rank (DistributedSampler pads), as many batches on each: ZeRO-3 forwards gather.
    test_slice = range(rank, len(test_set), world_size)
    batches = torch.arange(len(test_slice)).tensor_split(math.ceil(math.ceil(len(test_set) / world_size) / 256))
    test_loader = DataLoader(Subset(test_set, test_slice), batch_sampler=[batch.tolist() for batch in batches])

    model = build_model().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    config = {  # DeepSpeed's settings (a ds_config.json file elsewhere); the batch sizes must agree
        "train_batch_size": args.batch_size,  # global: micro-batch x gradient accumulation x world size
        "train_micro_batch_size_per_gpu": args.batch_size // world_size,
        "zero_optimization": {"stage": 2},  # 1: optimizer state partitioned, 2: and gradients, 3: and weights
        "zero_allow_untested_optimizer": True,  # a torch optimizer under ZeRO
        "bf16": {"enabled": False},  # True on GPUs that have it; then feed it bf16 inputs
    }
    # The engine broadcasts rank 0's weights, wraps the optimizer for ZeRO and averages the gradients.
    model, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    checkpoints = Path(args.output_dir, "checkpoints")
    start_epoch = 0
    if (checkpoints / "latest").is_file():  # a rerun, or torchrun --max-restarts: continue
        start_epoch = model.load_checkpoint(checkpoints)[1]["epoch"] + 1  # each rank reads its shard of `latest`

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # without it, every epoch repeats the first one's order
        model.train()
        loss_sum = torch.zeros(2, device=device)  # loss sum, batches
        for inputs, labels in train_loader:
            inputs, labels = inputs.to(device), labels.to(device)
            loss = F.cross_entropy(model(inputs), labels)
            model.backward(loss)  # instead of loss.backward(): the engine averages the gradients
            model.step()  # instead of optimizer.step() and zero_grad()
            loss_sum += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(loss_sum)  # every rank calls it: a collective that one rank skips hangs the others
        if not loss_sum.isfinite().all():  # the same sum on every rank: all stop, before saving NaN weights
            sys.exit(f"error: the loss diverged in epoch {epoch + 1}: lower --lr" if rank == 0 else 2)
        # Every rank must call it: each writes its own shard, with barriers inside (never in `if rank == 0`).
        model.save_checkpoint(checkpoints, tag=f"epoch{epoch}", client_state={"epoch": epoch}, save_latest=False)
        if rank == 0:  # no collective in here: the other ranks would never join it
            print(f"epoch {epoch + 1}/{args.epochs}  train_loss {(loss_sum[0] / loss_sum[1]).item():.4f}", flush=True)
            # `latest` after every shard, through a temporary file (DeepSpeed's is neither): a crash leaves it whole.
            (checkpoints / "latest.tmp").write_text(f"epoch{epoch}")
            os.replace(checkpoints / "latest.tmp", checkpoints / "latest")

    metrics = {"world_size": world_size, "epochs": args.epochs, **evaluate(model, test_loader, device)}
    if rank == 0:
        print(json.dumps(metrics), flush=True)
        # Under ZeRO the fp32 weights exist only as the ranks' shards: rebuilt from the last checkpoint.
        torch.save(get_fp32_state_dict_from_zero_checkpoint(checkpoints), os.path.join(args.output_dir, "model.pt"))
        Path(args.output_dir, "metrics.json").write_text(json.dumps(metrics, indent=2))
    dist.barrier()  # leave together: rank 0 may still be writing
    # Free what holds the process group first: its gloo threads would outlive it and abort Python's shutdown.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device):  # over the whole test set: each rank's slice, summed
    # DeepSpeed never synchronises buffers: evaluate with rank 0's BatchNorm statistics everywhere.
    for buffer in model.module.buffers():
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
