"""Step 08: the model split by layers: pipeline parallelism (`torch.distributed.pipelining`).

New (relative to step 04; lines marked `# [08]`): each rank holds a few of ResNet-9's blocks, a pipeline
stage, and passes each micro-batch's activations on (its gradients back) so that the stages work at once,
in the order of a schedule (GPipe or 1F1B). World size / `--stages` replicas of the pipeline split each
batch, as 04's ranks do. Each stage checkpoints its own part. Without GPUs: gloo on the CPU.

Launch:
    torchrun --nproc_per_node=N 08_cifar10_pipeline.py --amp bf16       # N GPUs on this machine: up to 4 stages
    torchrun --standalone --nproc_per_node=2 08_cifar10_pipeline.py --synthetic --epochs 1   # CPU (gloo), offline
    torchrun --standalone --nproc_per_node=4 08_cifar10_pipeline.py --synthetic --epochs 1 --stages 2   # 2 x 2
"""

import datetime  # [04]
import functools  # [08]
import os

import torch
import torch.distributed as dist  # [04]
import torch.distributed.checkpoint as dcp  # [08]
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict  # [08]
from torch.distributed.device_mesh import init_device_mesh  # [08]
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # [08]
from torch.utils.data import DistributedSampler, Subset  # [04]
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # [08]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser)  # [02]
    parser.add_argument("--stages", type=flags.positive_int,  # [08]
                        help="pipeline stages (default: the most that divide the world size, up to 5 and to "  # [08]
                        "--microbatches)")  # [08]
    parser.add_argument("--microbatches", type=flags.positive_int, default=4, help="per replica's batch")  # [08]
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b", help="GPipe or 1F1B")  # [08]
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
    if args.amp == "fp16":  # [08] a step skipped for an overflow would have to be skipped by every stage
        raise utils.UsageError("--amp fp16: 08 has no loss scaling across pipeline stages; use --amp bf16")  # [08]
    # By default every rank a stage, within ResNet-9's 5 blocks and 1F1B's micro-batches (replicas take the rest).
    most = min(world_size, len(models.RESNET9_BLOCKS), args.microbatches)  # [08]
    stages = args.stages or max(count for count in range(1, most + 1) if world_size % count == 0)  # [08]
    if world_size % stages or stages > len(models.RESNET9_BLOCKS):  # [08]
        raise utils.UsageError(f"--stages {stages} must divide the world size {world_size} and be at most "  # [08]
                               f"{len(models.RESNET9_BLOCKS)}, ResNet-9's blocks")  # [08]
    if args.schedule == "1f1b" and args.microbatches < stages:  # [08] its steady state: a micro-batch per stage
        raise utils.UsageError(f"--schedule 1f1b needs at least as many --microbatches as --stages ({stages})")  # [08]
    replicas = world_size // stages  # [08] each replica is a whole pipeline
    # The layout. By default some world sizes (5 or 7 with 4 micro-batches) get no pipeline: say why.
    no_pipeline = not args.stages and stages == 1 and world_size > 1  # [08]
    distributed.print0(f"{stages} stage(s) x {replicas} replica(s)" + (  # [08]
        f": no stage count from 2 to {most} divides {world_size} (--help)" if no_pipeline else ""))  # [08]
    if args.batch_size % (replicas * args.microbatches):  # [08] each replica cuts its share into micro-batches
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by {replicas} replica(s) x "  # [08]
                               f"--microbatches {args.microbatches}")  # [08]
    batch_size = args.batch_size // replicas  # [08] per replica: every stage of a replica sees this batch

    # Before the process group, whose timeout a slow download would outlast (one process per machine downloads).
    if not args.synthetic:
        data.download_cifar10(args.data_dir)
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    # rank = stage x replicas + replica: a stage's replicas are neighbours, its all-reduce within a machine.
    stage_index, replica = divmod(rank, replicas)  # [08] as the mesh below lays the ranks out
    # Every replica shuffles alike and keeps every replicas-th sample: disjoint shares of 01's global batch.
    # Per replica: all its stages read the same batches (the first stage uses the images, the last the labels).
    sampler = DistributedSampler(train_set, num_replicas=replicas, rank=replica, seed=args.seed, drop_last=True)  # [08]
    # Whole batches, cut and augmented on `device` in a few tensor operations (docs/data-and-model.md).
    train_loader = data.BatchLoader(train_set, batch_size, sampler=sampler, drop_last=True,  # [04]
                                    device=device, num_workers=args.num_workers)
    # A disjoint slice per replica; DistributedSampler would pad the slices with repeats, counting some twice.
    test_shard = Subset(test_set, range(replica, len(test_set), replicas))  # [08]
    test_loader = data.BatchLoader(test_shard, batch_size, device=device, num_workers=args.num_workers)  # [04]

    # After the checks of the input: a rank that stopped on bad input while the others connect would
    # break their connections, and they would fail with a traceback instead of its one error line.
    # 5 minutes, not gloo's 30 (NCCL's 10): a job whose rank died fails soon. device_id: NCCL joins its GPU now.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),  # [04]
                            device_id=torch.device("cuda", local_rank) if device.type == "cuda" else None)  # [04]
    preemption.connect()  # [04] its gloo group, now: a network that gloo cannot use fails here, not at step 1
    mesh = init_device_mesh(device.type, (stages, replicas), mesh_dim_names=("pp", "dp"))  # [08]

    model = models.ResNet9(norm=args.norm, width=args.width)  # [08]
    # Every rank builds the whole model from one seed and keeps its stage's blocks: one process's initial weights.
    model = models.pipeline_stage(model, stage_index, stages).to(device)  # [08]
    # Sends its outputs to the next stage's rank and receives its inputs, in the first micro-batch's shapes.
    stage = PipelineStage(model, stage_index, stages, device, group=mesh["pp"].get_group())  # [08]
    # Each micro-batch's loss is its mean, and the stages add up the micro-batches' gradients: the schedule
    # divides them by their number (scale_grads, the default), which gives the whole batch's gradients.
    loss_fn = functools.partial(F.cross_entropy, label_smoothing=args.label_smoothing)  # [08]
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches, loss_fn=loss_fn)  # [08]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps

    step, start_epoch = 0, 0
    # Started again (torchrun --max-restarts=K after a failure, a requeued Slurm job): go on from the last checkpoint.
    # Rank 0 decides, for every rank: a rank that cannot see the checkpoint stops the job with one error.
    if distributed.should_resume(args.resume, os.path.join(args.output_dir, "checkpoints", "latest")):  # [08]
        step, start_epoch = load_checkpoint(args, model, optimizer, scheduler, device)  # [08]
        if utils.finished(args.output_dir, step, last_step):  # run again after its end: rank 0 decides for all
            return

    record = utils.RunRecord(__file__, args, len(train_loader), device, amp=args.amp, world_size=world_size,  # [08]
                             stages=stages, microbatches=args.microbatches, schedule=args.schedule)  # [08]
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # [04] without it, DistributedSampler repeats epoch 0's order forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training()
        train_loss, new_step = train_one_epoch(args, schedule, stage, mesh, train_loader, optimizer, scheduler,  # [08]
                                               amp_dtype, device, epoch, step, last_step, preemption)  # [08]
        record.stop_training((new_step - step) * args.batch_size)
        step = new_step
        if preemption.stopped:  # [04] every rank stopped after this step, once the checkpoint was written
            raise utils.Preempted(preemption, step, args.output_dir)  # [04] exit status 75: continue with --resume
        test_loss, test_accuracy, test_samples = evaluate(schedule, stage, mesh, test_loader, batch_size,  # [08]
                                                          device, amp_dtype, args.tta)  # [08]
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = record.metrics()
    # The first replica's stages send rank 0 their parts, on the CPU (not on another rank's GPU), with ResNet9's keys.
    stage_part = {key: value.cpu() for key, value in model.state_dict().items()} if replica == 0 else {}  # [08]
    parts = [None] * world_size if rank == 0 else None  # [08]
    # A collective: every rank, outside the rank-0 branch. On gloo: under NCCL, gather_object would pad every
    # rank's pickle to the largest and gather them all onto rank 0's GPU.
    gather_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=5))  # [08] not gloo's 30
    dist.gather_object(stage_part, parts, dst=0, group=gather_group)  # [08]
    if rank == 0:  # [04] one writer. No collective in here: the other ranks would never join it.
        whole = {key: value for part in parts for key, value in part.items()}  # [08]
        utils.save_atomic(whole, os.path.join(args.output_dir, "model.pt"))  # [08]
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))  # [04]
    # Leave together: a gloo rank that tears down its connections while rank 0 is still writing can abort.
    dist.barrier()  # [04]
    dist.destroy_process_group()  # [04]


def train_one_epoch(args, schedule, stage, mesh, loader, optimizer, scheduler,  # [08]
                    amp_dtype, device, epoch, step, last_step, preemption):  # [08]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    stage.submod.train()  # [08]
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {epoch + 1}", leave=False, disable=dist.get_rank() != 0)  # [04]
    for images, labels in progress:
        optimizer.zero_grad(set_to_none=True)  # [08] before the schedule, whose backward passes fill the gradients
        losses = []  # [08] the last stage's: one loss per micro-batch
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            # Every micro-batch's forward and backward, in the schedule's order; the last stage computes the losses.
            schedule.step(*[images] if stage.is_first else [], target=labels, losses=losses)  # [08]
        # The replicas average their gradients, as DDP does (DDP cannot wrap a stage: docs/pipeline-parallel.md),
        # all of them in one all-reduce: one collective per step, not one per parameter.
        gradients = [parameter.grad for parameter in stage.submod.parameters()]  # [08]
        flat = torch.cat([gradient.flatten() for gradient in gradients])  # [08]
        dist.all_reduce(flat, group=mesh["dp"].get_group())  # [08]
        averaged = flat.div_(mesh["dp"].size()).split([gradient.numel() for gradient in gradients])  # [08]
        for gradient, average in zip(gradients, averaged, strict=True):  # [08]
            gradient.copy_(average.view_as(gradient))  # [08]
        optimizer.step()  # [08]
        scheduler.step()
        step += 1
        # Only the last stage has a loss; the others add zeros, which the sum over all ranks leaves out.
        loss = torch.stack(losses).mean() if stage.is_last else torch.zeros((), device=device)  # [08]
        loss_sum += loss.detach()
        # Every rank asks at every step: a rank that stopped alone would leave the others waiting in a collective.
        stop = preemption.should_stop()  # [04] True on all ranks at the same step if any was signalled
        checkpoint_due = stop or args.save_every and (step % args.save_every == 0 or step == last_step)  # [04]
        if step % 10 == 0 or step == last_step or checkpoint_due:  # reading the loss waits for the step to finish
            # Every rank runs the all-reduce, not rank 0 alone: a diverged run stops on all at the same step.
            logged_loss = distributed.all_reduce_mean(loss).item() * mesh["pp"].size()  # [08] the replicas' mean
            utils.check_finite(logged_loss, step)  # a diverged run stops here, before it saves its NaN weights
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if checkpoint_due:  # [08] every rank: each stage writes its own part
            save_checkpoint(args, stage.submod, mesh["dp"].get_group(), optimizer, scheduler, epoch, step)  # [08]
        if stop:  # [04]
            break  # [04]
    return distributed.all_reduce_mean(loss_sum).item() * mesh["pp"].size() / max(end - done, 1), step  # [08]


@torch.no_grad()
def evaluate(schedule, stage, mesh, loader, batch_size, device, amp_dtype, tta):  # [08]
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    stage.submod.eval()  # [08]
    # The first replica's BatchNorm statistics in every replica, the ones that model.pt keeps.
    distributed.broadcast_buffers(stage.submod, group=mesh["dp"].get_group())  # [08]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        # Every batch keeps the first one's shape (inferred once per evaluation): pad a smaller last one with zeros.
        count = len(labels)  # [08]
        images = torch.cat([images, images.new_zeros(batch_size - count, *images.shape[1:])])  # [08]
        padded_labels = torch.cat([labels, labels.new_zeros(batch_size - count)])  # [08]
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            # Forward passes only. The last stage gets the logits of the whole batch, the others None.
            logits = schedule.eval(*[images] if stage.is_first else [], target=padded_labels)  # [08]
            if tta:  # [08] test-time augmentation (models.predict): the mirror images through the pipeline too
                mirrored = schedule.eval(*[images.flip(-1)] if stage.is_first else [], target=padded_labels)  # [08]
        if not stage.is_last:  # [08] its totals stay 0
            continue  # [08]
        logits = (logits + mirrored) / 2 if tta else logits  # [08]
        logits = logits[:count]  # [08]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


# Optimizer state under each parameter's name (not per stage, whose groups would collide in the checkpoint).
CHECKPOINT_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)  # [08]


def save_checkpoint(args, model, dp_group, optimizer, scheduler, epoch, step):  # [08]
    """Everything a resumed run needs to continue as if it had never stopped."""
    directory = os.path.join(args.output_dir, "checkpoints")  # [08]
    # What the replicas hold alike is written once, from any: make BatchNorm's statistics the first replica's.
    distributed.broadcast_buffers(model, group=dp_group)  # [08]
    model_state, optimizer_state = get_state_dict(model, optimizer, options=CHECKPOINT_OPTIONS)  # [08]
    dcp.save({"model": model_state, "optimizer": optimizer_state},  # [08]
             checkpoint_id=os.path.join(directory, f"step{step}"))  # [08]
    if dist.get_rank() != 0:  # [08] the rest is the same on every rank: one writer
        return  # [08]
    utils.save_atomic({
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "step": step,
        "rng": utils.get_rng_state(),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "width": args.width,
    }, os.path.join(directory, f"step{step}", "train_state.pt"))  # [08]
    # `latest` last, atomically: a crash mid-save leaves it naming the previous, complete checkpoint.
    utils.write_text(f"step{step}", os.path.join(directory, "latest"))  # [08]
    utils.remove_other_checkpoints(directory, keep=f"step{step}")  # [08]


def load_checkpoint(args, model, optimizer, scheduler, device):  # [08]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    path = utils.latest_checkpoint(os.path.join(args.output_dir, "checkpoints"))  # [08]
    checkpoint = utils.load_checkpoint(os.path.join(path, "train_state.pt"), map_location=device)  # [08]
    utils.check_resumable(path, checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          width=args.width)
    # Every rank reads its own stage's parameters and their optimizer state, whoever wrote them.
    model_state, optimizer_state = get_state_dict(model, optimizer, options=CHECKPOINT_OPTIONS)  # [08]
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # [08]
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,  # [08]
                   options=CHECKPOINT_OPTIONS)  # [08]
    scheduler.load_state_dict(checkpoint["scheduler"])
    utils.set_rng_state(checkpoint["rng"])
    utils.report_resume(path, checkpoint)
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)  # [04] gloo threads would abort Python's shutdown (see utils.run)
