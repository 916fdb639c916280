"""Step 07: the same processes, with PyTorch's own sharding: FSDP2 (`fully_shard`).

New (relative to step 04; lines marked `# [07]`): instead of a whole replica per rank, each rank keeps 1/N
of every weight, gradient and optimizer state. `fully_shard` makes each residual block, each BatchNorm
layer and the root a unit, gathered just before it runs and freed after (the root's: after backward); the
gradients are reduce-scattered, so each rank updates only its shard. Checkpoints are sharded too
(torch.distributed.checkpoint): every rank writes and reads its own shard, and they load at any world
size. `--amp` is FSDP's mixed-precision policy instead of autocast. Without GPUs: gloo on the CPU.

Launch:
    torchrun --nproc_per_node=N 07_cifar10_fsdp.py --amp bf16              # N GPUs on this machine
    torchrun --standalone --nproc_per_node=2 07_cifar10_fsdp.py --synthetic --epochs 1   # CPU (gloo), offline
"""

import dataclasses  # [07]
import datetime  # [04]
import os

import torch
import torch.distributed as dist  # [04]
import torch.distributed.checkpoint as dcp  # [07]
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (  # [07] the sharded state, in and out
    StateDictOptions,  # [07]
    get_model_state_dict,  # [07]
    get_state_dict,  # [07]
    set_model_state_dict,  # [07]
    set_state_dict,  # [07]
)  # [07]
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # [07]
from torch.utils.data import DistributedSampler, Subset  # [04]
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser)  # [02]
    return parser.parse_args()


def main():
    args = parse_args()
    # SIGTERM or SIGUSR1 (preemption, a time limit near): stop at a step that all ranks agree on, saved.
    preemption = distributed.Preemption()  # [04] before anything slow: the default action would kill the process
    utils.seed_everything(args.seed)
    # torchrun tells each process its rank, its local rank (the GPU it drives) and the world size.
    distributed.default_to_a_world_of_one()  # [04] started by plain `python`
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))  # [04]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # [02]
    if device.type == "cuda":  # [02]
        distributed.require_one_gpu_per_process()  # [04]
        torch.cuda.set_device(local_rank)  # [04] before any CUDA work, or every process would use GPU 0
        utils.use_deterministic_kernels()  # [02] or --resume drifts from an uninterrupted run
    else:  # [02]
        distributed.print0("no GPU found: training on the CPU")  # [04]
    amp_dtype = flags.AMP_DTYPES[args.amp]  # [02] None: plain fp32
    if args.batch_size % world_size:  # [04] --batch-size is global: each process takes an equal share
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible "  # [04]
                               f"by the world size {world_size}")  # [04]
    batch_size = args.batch_size // world_size  # [04]

    # Before the process group, whose timeout a slow download would outlast (one process per machine downloads).
    if not args.synthetic:
        data.download_cifar10(args.data_dir)
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    # Every rank shuffles alike and keeps every world_size-th sample: disjoint shares of 01's global batch.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)  # [04]
    # Whole batches, cut and augmented on `device` in a few tensor operations (docs/data-and-model.md).
    train_loader = data.BatchLoader(train_set, batch_size, sampler=sampler, drop_last=True,  # [04]
                                    device=device, num_workers=args.num_workers)
    # A disjoint slice per rank; DistributedSampler would pad the slices with repeats, counting some twice.
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))  # [04]
    # Every forward pass gathers each unit's weights from every rank, so every rank must run as many test
    # batches as the others: each slice is cut into the same number of batches.
    test_batches = data.equal_batches(len(test_set), world_size, rank, batch_size)  # [07]
    test_loader = data.BatchLoader(test_shard, batch_sampler=test_batches, device=device,  # [07]
                                   num_workers=args.num_workers)  # [07]

    # After the checks of the input: a rank that stopped on bad input while the others connect would
    # break their connections, and they would fail with a traceback instead of its one error line.
    # 5 minutes, not gloo's 30 (NCCL's 10): a job whose rank died fails soon. device_id: NCCL joins its GPU now.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),  # [04]
                            device_id=torch.device("cuda", local_rank) if device.type == "cuda" else None)  # [04]
    preemption.connect()  # [04] its gloo group, now: a network that gloo cannot use fails here, not at step 1

    # On the meta device: the model's shapes, no memory. Each rank allocates only its shards (to_empty, below),
    # so a model larger than one GPU fits.
    with torch.device("meta"):  # [07]
        model = models.ResNet9(norm=args.norm, width=args.width)  # [07]
    # Each residual block and BatchNorm layer, then the root (the rest), becomes one unit: each rank keeps a shard
    # of its weights; its full weights are gathered just before the unit's forward and freed after, then gathered
    # again for its backward (not the root's: it keeps them from forward to backward). The gradients are
    # reduce-scattered: each rank gets the averaged gradient of its own shard, and its optimizer updates only that.
    # --amp: the gathered copies are cast to 16 bits; the gradients are reduced, and the shards kept, in fp32.
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32 if amp_dtype else None)  # [07]
    for module in reversed(list(model.modules())):  # [07] inner units first: an outer one takes what is left
        if isinstance(module, torch.nn.BatchNorm2d):  # [07] its fp32 statistics need fp32 weights, under --amp too
            fully_shard(module)  # [07]
        elif isinstance(module, models.Residual):  # [07]
            fully_shard(module, mp_policy=policy)  # [07]
    # The root returns the logits in fp32 under --amp (reduce_dtype), so that the loss is computed in fp32.
    fully_shard(model, mp_policy=dataclasses.replace(policy, output_dtype=policy.reduce_dtype))  # [07] in place
    model.to_empty(device=device)  # [07] this rank's shards, not yet initialised
    # One process's initial weights (the seed's), built in rank 0's CPU memory and sent tensor by tensor: each
    # rank keeps its shard of each, and never holds the whole model on its device.
    initial_weights = models.ResNet9(norm=args.norm, width=args.width).state_dict() if rank == 0 else {}  # [07]
    set_model_state_dict(model, initial_weights,  # [07]
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))  # [07]
    # After sharding: the optimizer must hold the shards (DTensors), not the full weights.
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    # fp16: every rank must agree to skip a step whose gradients overflowed, and each sees only its shard. The
    # gradients are DTensors, whose overflow check takes the maximum over the ranks: 04's scaler is enough.
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # [02] fp16: small gradients would underflow

    step, start_epoch = 0, 0
    # Started again (torchrun --max-restarts=K after a failure, a requeued Slurm job): go on from the last checkpoint.
    # Rank 0 decides, for every rank: a rank that cannot see the checkpoint stops the job with one error.
    if distributed.should_resume(args.resume, os.path.join(args.output_dir, "checkpoints", "latest")):  # [07]
        step, start_epoch = load_checkpoint(args, model, optimizer, scheduler, scaler, device)  # [02]
        if utils.finished(args.output_dir, step, last_step):  # run again after its end: rank 0 decides for all
            return

    record = utils.RunRecord(__file__, args, len(train_loader), device, amp=args.amp, world_size=world_size)  # [04]
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # [04] without it, DistributedSampler repeats epoch 0's order forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training()
        train_loss, new_step = train_one_epoch(args, model, train_loader, optimizer, scheduler,
                                               scaler, device, epoch, step, last_step, preemption)  # [07]
        record.stop_training((new_step - step) * args.batch_size)
        step = new_step
        if preemption.stopped:  # [04] every rank stopped after this step, once the checkpoint was written
            raise utils.Preempted(preemption, step, args.output_dir)  # [04] exit status 75: continue with --resume
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device, args.tta)  # [07]
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = record.metrics()
    # Gathering the full weights is a collective: every rank takes part, rank 0 alone receives them (the
    # others get an empty dict), on the CPU, in fp32: model.pt in the format of every other step.
    state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))  # [07]
    if rank == 0:  # [04] one writer. No collective in here: the other ranks would never join it.
        utils.save_atomic(state_dict, os.path.join(args.output_dir, "model.pt"))  # [07]
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))  # [04]
    # Leave together: a gloo rank that tears down its connections while rank 0 is still writing can abort.
    dist.barrier()  # [04]
    dist.destroy_process_group()  # [04]


def train_one_epoch(args, model, loader, optimizer, scheduler,
                    scaler, device, epoch, step, last_step, preemption):  # [07]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {epoch + 1}", leave=False, disable=dist.get_rank() != 0)  # [04]
    for images, labels in progress:
        loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)  # [07] FSDP casts
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # [02]
        scaler.step(optimizer)  # [02] unscales the gradients; skips the step if they overflowed
        scaler.update()  # [02]
        scheduler.step()
        step += 1
        loss_sum += loss.detach()
        # Every rank asks at every step: a rank that stopped alone would leave the others waiting in a collective.
        stop = preemption.should_stop()  # [04] True on all ranks at the same step if any was signalled
        checkpoint_due = stop or args.save_every and (step % args.save_every == 0 or step == last_step)  # [04]
        if step % 10 == 0 or step == last_step or checkpoint_due:  # reading the loss waits for the step to finish
            # Every rank runs the all-reduce, not rank 0 alone: a diverged run stops on all at the same step.
            logged_loss = distributed.all_reduce_mean(loss).item()  # [04]
            utils.check_finite(logged_loss, step)  # a diverged run stops here, before it saves its NaN weights
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if checkpoint_due:  # [07] every rank: its own shard
            save_checkpoint(args, model, optimizer, scheduler, scaler, epoch, step)  # [02]
        if stop:  # [04]
            break  # [04]
    return distributed.all_reduce_mean(loss_sum).item() / max(end - done, 1), step  # [04]


@torch.no_grad()
def evaluate(model, loader, device, tta):  # [07]
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    # FSDP shards the parameters only: each rank's BatchNorm statistics have followed its own batches.
    # Evaluate with rank 0's everywhere, the ones that model.pt keeps.
    distributed.broadcast_buffers(model)  # [07]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        logits = models.predict(model, images, flip=tta)  # [07]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, model, optimizer, scheduler, scaler, epoch, step):  # [02]
    """Everything a resumed run needs to continue as if it had never stopped."""
    directory = os.path.join(args.output_dir, "checkpoints")  # [07]
    # A tensor that is not sharded is written once, from any rank: make the buffers rank 0's everywhere.
    distributed.broadcast_buffers(model)  # [07]
    # The weights and the optimizer state stay sharded: every rank writes its own shards, in parallel.
    model_state, optimizer_state = get_state_dict(model, optimizer)  # [07] DTensors: this rank's shards
    dcp.save({"model": model_state, "optimizer": optimizer_state},  # [07]
             checkpoint_id=os.path.join(directory, f"step{step}"))  # [07]
    if dist.get_rank() != 0:  # [07] the rest is the same on every rank: one writer
        return  # [07]
    utils.save_atomic({
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),  # [02] the current loss scale
        "epoch": epoch,
        "step": step,
        "rng": utils.get_rng_state(),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "width": args.width,
    }, os.path.join(directory, f"step{step}", "train_state.pt"))  # [07]
    # `latest` last, atomically: a crash mid-save leaves it naming the previous, complete checkpoint.
    utils.write_text(f"step{step}", os.path.join(directory, "latest"))  # [07]
    utils.remove_other_checkpoints(directory, keep=f"step{step}")  # [07]


def load_checkpoint(args, model, optimizer, scheduler, scaler, device):  # [02]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    path = utils.latest_checkpoint(os.path.join(args.output_dir, "checkpoints"))  # [07]
    checkpoint = utils.load_checkpoint(os.path.join(path, "train_state.pt"), map_location=device)  # [07]
    utils.check_resumable(path, checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          width=args.width)
    # Every rank reads the parts of the shards it now holds: a checkpoint loads at any world size.
    model_state, optimizer_state = get_state_dict(model, optimizer)  # [07] what to fill, sharded as now
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # [07]
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)  # [07]
    scheduler.load_state_dict(checkpoint["scheduler"])
    scaler.load_state_dict(checkpoint["scaler"])  # [02]
    utils.set_rng_state(checkpoint["rng"])
    utils.report_resume(path, checkpoint)
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)  # [04] gloo threads would abort Python's shutdown (see utils.run)
