"""Step 08: the model split by layers: pipeline parallelism (`torch.distributed.pipelining`).

New (relative to step 04; lines marked `# [08]`): each rank holds a few of ResNet-9's blocks, a
pipeline stage, and passes each micro-batch's activations on (its gradients back), so that the
stages work at once, in a schedule's order (GPipe, 1F1B). World size / `--stages` replicas of the
pipeline split each batch, as 04's ranks do. Each stage checkpoints its own part.

Launch:
    torchrun --nproc_per_node=N 08_cifar10_pipeline.py --amp bf16  # N GPUs: up to 4 stages
    torchrun --standalone --nproc_per_node=2 08_cifar10_pipeline.py --synthetic --epochs 1  # CPU
    torchrun --standalone --nproc_per_node=4 08_cifar10_pipeline.py --synthetic --stages 2  # 2 x 2
"""

import functools  # [08]
import os

import torch
import torch.distributed as dist  # [04]
import torch.distributed.checkpoint as dcp  # [08]
import torch.distributed.checkpoint.state_dict as dcp_state  # [08] the state of a stage, in and out
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh  # [08]
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe  # [08]
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # [08]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser)  # [02]
    flags.add_pipeline_arguments(parser, schedules=list(SCHEDULES))  # [08] --stages, --microbatches
    return parser.parse_args()


def main():
    args = parse_args()
    distributed.catch_stop_signals()  # [04] first: until then SIGTERM, SIGUSR1 kill the process
    context = setup(args)
    distributed.connect_stop_flag()  # [04] its own gloo group: fails here if gloo has no network
    train_set, sampler, train_loader, test_loader = build_data(context)
    stage, schedule = build_model(context)  # [08] this rank's stage, and the schedule that runs it
    model = stage.submod  # [08] the stage's blocks
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    state = utils.State(stage, optimizer, scheduler, last_step)  # [08] bf16 or fp32: no scaler

    # Started again (torchrun --max-restarts, a requeued Slurm job)? The ranks decide together.
    if distributed.should_resume(args.resume, args.output_dir, "checkpoints", "latest"):  # [08]
        load_checkpoint(context, state)
        if utils.finished(args.output_dir, state.step, last_step):  # run again after its end
            return

    record = utils.RunRecord(__file__, context, len(train_loader),  # [08]
                             microbatches=args.microbatches, schedule=args.schedule)  # [08]
    for epoch in range(state.epoch, args.epochs):  # from the checkpoint's epoch if resumed
        state.epoch = epoch
        sampler.set_epoch(epoch)  # a new order each epoch, or epoch 0's forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training(state.step)
        train_loss = train_one_epoch(context, state, train_loader, schedule)  # [08]
        record.stop_training(state.step)
        test_loss, test_accuracy, test_samples = evaluate(context, stage, test_loader,  # [08]
                                                          schedule)  # [08]
        record.end_epoch(epoch, state.step, train_loss, test_loss, test_accuracy, test_samples)
        if state.step >= last_step:
            break

    metrics = record.metrics()  # wall_seconds ends here, before the final writes
    # The first replica's stages send rank 0 their parts, with ResNet9's keys: a collective, so
    # every rank calls it, outside the rank-0 branch.
    weights = distributed.gather_weights(model.state_dict(), send=context.replica == 0)  # [08]
    if context.rank == 0:  # [04] one writer; no collective inside: no other rank would join it
        utils.write_outputs(args.output_dir, weights, metrics)  # [08]
    dist.barrier()  # [04] leave together: a rank that leaves while rank 0 writes can abort it
    dist.destroy_process_group()  # [04]


def setup(args):
    """What the run is, read by every function below (common/utils.py's Context)."""
    utils.seed_everything(args.seed)
    distributed.default_to_a_world_of_one()  # [04] started by plain `python`
    # torchrun sets each process's rank, local rank (its GPU), world size; Context reads the rank.
    local_rank, world_size = (int(os.environ[key]) for key in ("LOCAL_RANK", "WORLD_SIZE"))  # [04]
    # A step skipped for an overflow would have to be skipped by every stage.
    if args.amp == "fp16":  # [08]
        raise utils.UsageError("--amp fp16: 08 has no loss scaling across pipeline stages; "  # [08]
                               "use --amp bf16")  # [08]
    # S stages x R replicas = the world size; each replica cuts its share into M micro-batches.
    stages, replicas = distributed.pipeline_layout(args, world_size)  # [08]
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
    # rank = stage x replicas + replica: a stage's replicas are neighbours, on one machine.
    mesh = init_device_mesh(device.type, (stages, replicas), mesh_dim_names=("pp", "dp"))  # [08]
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp], mesh=mesh)  # [08]


def build_data(context):
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
    # Per replica: all its stages read the same batches (the first the images, the last the labels).
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
    """This rank's pipeline stage of the model (common/models.py), and the schedule that runs it."""
    args, mesh = context.args, context.mesh  # [08]
    stage_index, stages = mesh.get_local_rank("pp"), mesh["pp"].size()  # [08]
    # Every rank builds the whole model from one seed and keeps its stage's blocks: 01's weights.
    model = models.pipeline_stage(models.build(args), stage_index, stages)  # [08]
    model = model.to(context.device)  # [08]
    # Sends its outputs to the next stage, receives its inputs, in the first micro-batch's shapes.
    stage = PipelineStage(model, stage_index, stages, context.device,  # [08]
                          group=mesh["pp"].get_group())  # [08]
    # Each micro-batch's loss is its mean, and the stages add up the micro-batches' gradients: the
    # schedule divides them by their number (scale_grads, the default): the whole batch's gradients.
    loss_fn = functools.partial(F.cross_entropy, label_smoothing=args.label_smoothing)  # [08]
    schedule = SCHEDULES[args.schedule](stage, n_microbatches=args.microbatches,  # [08]
                                        loss_fn=loss_fn)  # [08]
    return stage, schedule  # [08]


def train_one_epoch(context, state, loader, schedule):  # [08]
    """Train until the end of the epoch or the run's last step; returns the mean loss."""
    args, device, stage = context.args, context.device, state.model  # [08]
    amp_dtype, mesh = context.amp_dtype, context.mesh  # [08]
    stage.submod.train()  # [08]
    done = state.step - state.epoch * len(loader)  # batches of this epoch trained before a resume
    end = min(len(loader), done + state.last_step - state.step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {state.epoch + 1}", leave=False, disable=context.rank != 0)  # [04]
    for images, labels in progress:
        # Before the schedule, whose backward passes fill the gradients.
        state.optimizer.zero_grad(set_to_none=True)  # [08]
        losses = []  # [08] the last stage's: one loss per micro-batch
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            # Every micro-batch's forward and backward, in the schedule's order; losses on the last.
            schedule.step(*[images] if stage.is_first else [], target=labels, losses=losses)  # [08]
        # The replicas average their gradients as DDP would (not DDP: docs/pipeline-parallel.md).
        distributed.average_gradients(stage.submod, mesh["dp"].get_group())  # [08]
        state.optimizer.step()  # [08]
        state.scheduler.step()
        state.step += 1
        # Only the last stage has a loss; the others add zeros, which the sum over ranks leaves out.
        loss = torch.stack(losses).mean() if losses else torch.zeros((), device=device)  # [08]
        loss_sum += loss.detach()
        at_end = state.step == state.last_step
        stop = distributed.should_stop()  # [04] every rank, every step: none may stop alone
        save_due = stop or args.save_every and (state.step % args.save_every == 0 or at_end)  # [04]
        # Reading the loss waits for the step to finish: every 10 steps, at the end, before a save.
        if state.step % 10 == 0 or at_end or save_due:
            # On every rank: all stop on a NaN at once. Times the stages: the replicas' mean.
            logged_loss = distributed.all_reduce_mean(loss).item() * mesh["pp"].size()  # [08]
            utils.check_finite(logged_loss, state.step)  # a diverged run stops before it saves NaNs
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if save_due:
            save_checkpoint(context, state)
        if stop:  # [04] every rank stops after this step, saved: exit status 75
            raise utils.Preempted(state.step, args.output_dir)  # [04]
    mean = distributed.all_reduce_mean(loss_sum).item() * mesh["pp"].size()  # [08]
    return mean / max(end - done, 1)  # [08]


@torch.no_grad()
def evaluate(context, stage, loader, schedule):  # [08] this rank's stage, not a model
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    device = context.device
    amp_dtype = context.amp_dtype  # [02]
    # One shape for every batch (the stages infer it once per evaluation): the training batch's,
    # which the micro-batches divide, or the longest test batch if longer (1 sample per replica).
    size = max(context.args.batch_size // context.mesh["dp"].size(), loader.largest_batch)  # [08]
    stage.submod.eval()  # [08]
    # The first replica's BatchNorm statistics in every replica, the ones that model.pt keeps.
    distributed.broadcast_buffers(stage.submod, group=context.mesh["dp"].get_group())  # [08]
    # The loss sum, the correct predictions, the samples.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        count = len(labels)  # [08]
        images, padded_labels = data.pad_batch(images, labels, size)  # [08] zeros up to that shape
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            # Forward passes only (--tta: of the mirror images too); the last stage gets the logits.
            views = [images, images.flip(-1)] if context.args.tta else [images]  # [08]
            inputs = [[view] if stage.is_first else [] for view in views]  # [08] the first's only
            outputs = [schedule.eval(*view, target=padded_labels) for view in inputs]  # [08]
        if not stage.is_last:  # [08] its totals stay 0
            continue  # [08]
        logits = (sum(outputs) / len(outputs))[:count]  # [08] the views' mean, as models.predict
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


# Optimizer state under each parameter's name (not per stage, whose groups would collide).
BY_NAME = dcp_state.StateDictOptions(flatten_optimizer_state_dict=True)  # [08]


def save_checkpoint(context, state):
    """Everything a resumed run needs to continue as if it had never stopped."""
    args, directory = context.args, os.path.join(context.args.output_dir, "checkpoints")  # [08]
    model, path = state.model.submod, os.path.join(directory, f"step{state.step}")  # [08]
    # What the replicas hold alike is written once, from any: BatchNorm's statistics, the first's.
    distributed.broadcast_buffers(model, group=context.mesh["dp"].get_group())  # [08]
    model_state, optimizer_state = dcp_state.get_state_dict(model, state.optimizer,  # [08]
                                                            options=BY_NAME)  # [08]
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # [08]
    if context.rank != 0:  # [04] what follows is the same on every rank: one writer
        return  # [04]
    utils.save_atomic({
        "scheduler": state.scheduler.state_dict(),
        "epoch": state.epoch,
        "step": state.step,
        "rng": utils.get_rng_state(),
        **utils.resume_settings(args),  # load_checkpoint refuses a resume with others
    }, os.path.join(path, "train_state.pt"))  # [08]
    utils.commit_checkpoint(directory, f"step{state.step}")  # [08] `latest` names it, last


def load_checkpoint(context, state):
    """Restore `save_checkpoint`'s state into `state`, and say where the run continues."""
    args, model = context.args, state.model.submod  # [08]
    path = utils.latest_checkpoint(os.path.join(args.output_dir, "checkpoints"))  # [08]
    checkpoint = utils.load_checkpoint(os.path.join(path, "train_state.pt"), "cpu")  # [08]
    utils.check_resumable(path, checkpoint, **utils.resume_settings(args))
    # Every rank reads its own stage's parameters and their optimizer state, whoever wrote them.
    model_state, optimizer_state = dcp_state.get_state_dict(model, state.optimizer,  # [08]
                                                            options=BY_NAME)  # [08]
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # [08]
    dcp_state.set_state_dict(model, state.optimizer, model_state_dict=model_state,  # [08]
                             optim_state_dict=optimizer_state, options=BY_NAME)  # [08]
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    utils.set_rng_state(checkpoint["rng"])
    state.step, state.epoch = checkpoint["step"], checkpoint["epoch"]
    utils.report_resume(path, checkpoint)


if __name__ == "__main__":
    utils.run(main)
