"""Step 04: one process per GPU, with `DistributedDataParallel` (DDP), launched by torchrun.

New (relative to step 02; lines marked `# [04]`): each process trains on a share of every batch.

Launch:
    torchrun --nproc_per_node=N 04_cifar10_ddp.py --amp bf16                           # N GPUs
    torchrun --standalone --nproc_per_node=2 04_cifar10_ddp.py --synthetic --epochs 1  # CPU, gloo
"""

import os

import torch
import torch.distributed as dist  # [04]
import torch.nn.functional as F
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser)  # [02]
    return parser.parse_args()


def main():
    args = parse_args()
    distributed.catch_stop_signals()  # [04] first: until then SIGTERM, SIGUSR1 kill the process
    context = setup(args)
    distributed.connect_stop_flag()  # [04] its own gloo group: fails here if gloo has no network
    train_set, sampler, train_loader, test_loader = build_data(context)
    model = build_model(context)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    # fp16: small gradients would underflow. The scaler multiplies the loss, later divides them.
    scaler = torch.amp.GradScaler(context.device.type, enabled=args.amp == "fp16")  # [02]
    state = utils.State(model, optimizer, scheduler, last_step, scaler)  # [02]

    # Started again (torchrun --max-restarts, a requeued Slurm job)? The ranks decide together.
    if distributed.should_resume(args.resume, args.output_dir, "checkpoint.pt"):  # [04]
        load_checkpoint(context, state)
        if utils.finished(args.output_dir, state.step, last_step):  # run again after its end
            return

    record = utils.RunRecord(__file__, context, len(train_loader))
    for epoch in range(state.epoch, args.epochs):  # from the checkpoint's epoch if resumed
        state.epoch = epoch
        sampler.set_epoch(epoch)  # a new order each epoch, or epoch 0's forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training(state.step)
        train_loss = train_one_epoch(context, state, train_loader)
        record.stop_training(state.step)
        test_loss, test_accuracy, test_samples = evaluate(context, model, test_loader)
        record.end_epoch(epoch, state.step, train_loss, test_loss, test_accuracy, test_samples)
        if state.step >= last_step:
            break

    metrics = record.metrics()  # wall_seconds ends here, before the final writes
    if context.rank == 0:  # [04] one writer; no collective inside: no other rank would join it
        utils.write_outputs(args.output_dir, model.module.state_dict(), metrics)  # [04]
    dist.barrier()  # [04] leave together: a rank that leaves while rank 0 writes can abort it
    dist.destroy_process_group()  # [04]


def setup(args):
    """What the run is, read by every function below (common/utils.py's Context)."""
    utils.seed_everything(args.seed)
    distributed.default_to_a_world_of_one()  # [04] started by plain `python`
    # torchrun sets each process's rank, local rank (its GPU), world size; Context reads the rank.
    local_rank, world_size = (int(os.environ[key]) for key in ("LOCAL_RANK", "WORLD_SIZE"))  # [04]
    distributed.require_divisible_batch(args.batch_size, world_size)  # [04] a share per process
    if not args.synthetic:
        data.download_cifar10(args.data_dir)
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")  # [04]
    if device.type == "cuda":  # [02]
        distributed.require_one_gpu_per_process()  # [04]
        torch.cuda.set_device(device)  # [04] before any CUDA work, or every process would use GPU 0
        utils.use_deterministic_kernels()  # [02] or --resume drifts from an uninterrupted run
    else:  # [02]
        distributed.print0("no GPU found: training on the CPU")  # [04]
    # The process group connects the processes for collectives (broadcast, all-reduce...): NCCL on
    # GPUs, gloo on CPUs. Joined last: a slow download, or one rank's failed check, would fail them.
    backend = "nccl" if device.type == "cuda" else "gloo"  # [04]
    dist.init_process_group(backend, timeout=distributed.TIMEOUT,  # [04]
                            device_id=device if backend == "nccl" else None)  # [04] NCCL: its GPU
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp])  # [02] None: fp32


def build_data(context):
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
    replica, replicas = context.replica, context.replicas  # [04] a process, or a group of them
    batch_size = args.batch_size // replicas  # [04] this replica's share of each global batch
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set "
                               f"({len(train_set)})")
    # One order per seed and epoch; from 04 on, each replica keeps every replicas-th sample of it.
    sampler = DistributedSampler(train_set, num_replicas=replicas, rank=replica,  # [04]
                                 seed=args.seed, drop_last=True)  # [04]
    # Whole batches, cut and augmented on `device` in a few tensor ops (docs/data-and-model.md).
    train_loader = data.BatchLoader(train_set, batch_size, sampler=sampler, drop_last=True,  # [04]
                                    device=device, num_workers=args.num_workers)
    # A disjoint slice per replica: DistributedSampler would pad the slices, counting samples twice.
    # As many batches in each: from 05 on, a forward pass can be a collective that every rank joins.
    test_batches = data.equal_batches(len(test_set), replicas, replica, batch_size)  # [04]
    test_loader = data.BatchLoader(test_set, batch_sampler=test_batches, device=device,  # [04]
                                   num_workers=args.num_workers)
    return train_set, sampler, train_loader, test_loader


def build_model(context):
    """The model (common/models.py), on the run's device, as this step trains it."""
    model = models.build(context.args).to(context.device)
    # DDP broadcasts rank 0's weights, then averages the gradients in backward: replicas stay equal.
    model = torch.nn.parallel.DistributedDataParallel(model)  # [04] its inputs are on its device
    return model


def train_one_epoch(context, state, loader):
    """Train until the end of the epoch or the run's last step; returns the mean loss."""
    args, device, model = context.args, context.device, state.model
    amp_dtype = context.amp_dtype  # [02]
    model.train()
    done = state.step - state.epoch * len(loader)  # batches of this epoch trained before a resume
    end = min(len(loader), done + state.last_step - state.step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {state.epoch + 1}", leave=False, disable=context.rank != 0)  # [04]
    for images, labels in progress:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            logits = model(images)  # [02]
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)  # [02]
        state.optimizer.zero_grad(set_to_none=True)
        state.scaler.scale(loss).backward()  # [02]
        # Unscales the gradients, and skips the step if they overflowed (inf or NaN).
        state.scaler.step(state.optimizer)  # [02]
        state.scaler.update()  # [02]
        state.scheduler.step()
        state.step += 1
        loss_sum += loss.detach()
        at_end = state.step == state.last_step
        stop = distributed.should_stop()  # [04] every rank, every step: none may stop alone
        save_due = stop or args.save_every and (state.step % args.save_every == 0 or at_end)  # [04]
        # Reading the loss waits for the step to finish: every 10 steps, at the end, before a save.
        if state.step % 10 == 0 or at_end or save_due:
            logged_loss = distributed.all_reduce_mean(loss).item()  # [04] all stop on a NaN at once
            utils.check_finite(logged_loss, state.step)  # a diverged run stops before it saves NaNs
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if save_due:
            save_checkpoint(context, state)
        if stop:  # [04] every rank stops after this step, saved: exit status 75
            raise utils.Preempted(state.step, args.output_dir)  # [04]
    return distributed.all_reduce_mean(loss_sum).item() / max(end - done, 1)  # [04]


@torch.no_grad()
def evaluate(context, model, loader):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    device = context.device
    amp_dtype = context.amp_dtype  # [02]
    model.eval()
    # Rank 0's BatchNorm statistics on every rank: the forward passes below never sync buffers.
    distributed.broadcast_buffers(model)  # [04]
    # The loss sum, the correct predictions, the samples.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            logits = models.predict(model.module, images, flip=context.args.tta)  # [04]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(context, state):
    """Everything a resumed run needs to continue as if it had never stopped."""
    args = context.args
    if context.rank != 0:  # [04] what follows is the same on every rank: one writer
        return  # [04]
    utils.save_atomic({
        "model": state.model.module.state_dict(),  # [04] not DDP's: no "module." prefixes
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict(),
        "scaler": state.scaler.state_dict(),  # [02] the current loss scale
        "epoch": state.epoch,
        "step": state.step,
        "rng": utils.get_rng_state(),
        **utils.resume_settings(args),  # load_checkpoint refuses a resume with others
    }, os.path.join(args.output_dir, "checkpoint.pt"))


def load_checkpoint(context, state):
    """Restore `save_checkpoint`'s state into `state`, and say where the run continues."""
    args, path = context.args, os.path.join(context.args.output_dir, "checkpoint.pt")
    checkpoint = utils.load_checkpoint(path, map_location=context.device)
    utils.check_resumable(path, checkpoint, **utils.resume_settings(args))
    state.model.module.load_state_dict(checkpoint["model"])  # [04]
    state.optimizer.load_state_dict(checkpoint["optimizer"])
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    state.scaler.load_state_dict(checkpoint["scaler"])  # [02]
    utils.set_rng_state(checkpoint["rng"])
    state.step, state.epoch = checkpoint["step"], checkpoint["epoch"]
    utils.report_resume(path, checkpoint)


if __name__ == "__main__":
    utils.run(main)
