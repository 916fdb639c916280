"""Step 05: the same processes, with the DeepSpeed engine: ZeRO, mixed precision, ds_config.json.

New (relative to step 04; lines marked `# [05]`): `deepspeed.initialize` wraps 04's model, optimizer
and schedule in an engine that averages the gradients (of accumulated micro-batches too), and
under ZeRO 1-3 shards the optimizer state, gradients and weights and checkpoints a shard per rank.

Launch:
    deepspeed --num_gpus=N 05_cifar10_deepspeed.py --amp bf16           # N GPUs on this machine
    torchrun --nproc_per_node=N 05_cifar10_deepspeed.py --zero-stage 3  # the same, by torchrun
    OMP_NUM_THREADS=1 deepspeed --num_gpus=2 05_cifar10_deepspeed.py --synthetic --epochs 1  # CPU
Without GPUs --num_gpus is the number of processes, and the first run compiles a small op with the
environment's ninja (activate it). Several machines, hostfiles, ssh: docs/deepspeed.md.
"""

import os

import deepspeed  # [05]
import torch
import torch.distributed as dist  # [04]
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # [05]
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser, fp16_cpu_refusal="05 runs DeepSpeed's fp16 on GPUs only")  # [05]
    flags.add_deepspeed_arguments(parser)  # [05] --zero-stage, accumulation, the config file
    return parser.parse_args()


def main():
    args = parse_args()
    distributed.catch_stop_signals()  # [04] first: until then SIGTERM, SIGUSR1 kill the process
    context, config = setup(args)  # [05] and DeepSpeed's settings
    distributed.connect_stop_flag()  # [04] its own gloo group: fails here if gloo has no network
    train_set, sampler, train_loader, test_loader = build_data(context, config)  # [05]
    model = build_model(context)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True,
                                weight_decay=5e-4)
    # N micro-batches per optimizer step; an epoch's incomplete last group of N is left out (the
    # engine counts micro-batches across epochs: it would join the next epoch's first step).
    steps_per_epoch = len(train_loader) // config["gradient_accumulation_steps"]  # [05]
    total_steps = args.epochs * steps_per_epoch  # [05] the engine steps the schedule with them
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    # Broadcasts rank 0's weights, wraps the optimizer for ZeRO, averages the gradients.
    model, optimizer, _, scheduler = deepspeed.initialize(  # [05]
        model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)  # [05]
    distributed.remove_deepspeed_shared_memory()  # [05] CPU, deepspeed launcher: 69 MB per rank
    # fp16: small gradients would underflow. The scaler multiplies the loss, later divides them.
    scaler = utils.deepspeed_grad_scaler(model)  # [05] the engine's: its checkpoints leave it out
    state = utils.State(model, optimizer, scheduler, last_step, scaler)  # [02]

    # Started again (torchrun --max-restarts, a requeued Slurm job)? The ranks decide together.
    if distributed.should_resume(args.resume, args.output_dir, "checkpoints", "latest"):  # [05]
        load_checkpoint(context, state)
        if utils.finished(args.output_dir, state.step, last_step):  # run again after its end
            return

    record = utils.RunRecord(__file__, context, steps_per_epoch,  # [05]
                             zero_stage=model.zero_optimization_stage())  # [05]
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
        # Under ZeRO-3 each rank holds a shard of the weights only: DeepSpeed's zero_to_fp32, its
        # offline converter, reassembles them from the final checkpoint. fp32, also under --amp.
        if model.zero_optimization_stage() == 3:  # [05]
            checkpoints = os.path.join(args.output_dir, "checkpoints")  # [05]
            weights = get_fp32_state_dict_from_zero_checkpoint(checkpoints)  # [05]
        else:  # [05] ZeRO-0 to 2: every rank holds the whole model, in model.module
            weights = model.module.state_dict()  # [05]
        utils.write_outputs(args.output_dir, weights, metrics)  # [05]
    dist.barrier()  # [04] leave together: a rank that leaves while rank 0 writes can abort it
    dist.destroy_process_group()  # [04]


def setup(args):
    """What the run is, read by every function below (common/utils.py's Context)."""
    utils.seed_everything(args.seed)
    distributed.default_to_a_world_of_one()  # [04] started by plain `python`
    # torchrun sets each process's rank, local rank (its GPU), world size; Context reads the rank.
    local_rank, world_size = (int(os.environ[key]) for key in ("LOCAL_RANK", "WORLD_SIZE"))  # [04]
    distributed.require_divisible_batch(args.batch_size, world_size)  # [04] a share per process
    config = utils.read_json(args.deepspeed_config, "--deepspeed-config")  # [05]
    accumulation = (args.gradient_accumulation_steps  # [05]
                    or config.get("gradient_accumulation_steps", 1))  # [05]
    if args.batch_size // world_size % accumulation:  # [05] each process's share is N micro-batches
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by the "  # [05]
                               f"world size {world_size} times "  # [05]
                               f"--gradient_accumulation_steps {accumulation}")  # [05]
    # The command line wins where it and ds_config.json both speak. --batch-size stays the global
    # batch (DeepSpeed checks train_batch_size = micro-batch x accumulation steps x world size).
    micro_batch = args.batch_size // world_size // accumulation  # [05]
    config.update(train_batch_size=args.batch_size,  # [05]
                  train_micro_batch_size_per_gpu=micro_batch,  # [05]
                  gradient_accumulation_steps=accumulation)  # [05]
    # torch.autocast, not DeepSpeed's "bf16" and "fp16", which cast every parameter (BatchNorm's
    # too) to 16 bits. Its forward runs in the config's autocast (on GPUs, without it, ours is off).
    if args.amp != "none":  # [05]
        config["torch_autocast"] = {"enabled": True, "dtype": args.amp}  # [05] fp16: a GradScaler
    if args.zero_stage is not None:  # [05]
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage  # [05]
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
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp]), config  # [05]


def build_data(context, config):  # [05]
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
    replica, replicas = context.replica, context.replicas  # [04] a process, or a group of them
    batch_size = config["train_micro_batch_size_per_gpu"]  # [05] one forward and backward pass
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
    return model


def train_one_epoch(context, state, loader):
    """Train until the end of the epoch or the run's last step; returns the mean loss."""
    args, device, model = context.args, context.device, state.model
    amp_dtype = context.amp_dtype  # [02]
    accumulation = model.gradient_accumulation_steps()  # [05] micro-batches per optimizer step
    model.train()
    # Micro-batches of this epoch trained before a resume, and this epoch's last one.
    done = (state.step - state.epoch * (len(loader) // accumulation)) * accumulation  # [05]
    end = min(len(loader) // accumulation * accumulation,  # [05]
              done + (state.last_step - state.step) * accumulation)  # [05]
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {state.epoch + 1}", leave=False, disable=context.rank != 0)  # [04]
    for images, labels in progress:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            logits = model(images)  # [02]
            loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)  # [02]
        boundary = model.is_gradient_accumulation_boundary()  # [05] the Nth? Ask before step()
        model.backward(loss)  # [05] scales the loss by 1/N (and for fp16), averages the gradients
        # At the Nth: optimizer step (unless fp16 overflowed), schedule, zero_grad.
        model.step()  # [05]
        loss_sum += loss.detach()  # [05] every micro-batch's loss: the mean is over all of them
        if not boundary:  # [05] the first N-1 micro-batches of a step only add up gradients
            continue  # [05]
        state.step += 1
        at_end = state.step == state.last_step
        stop = distributed.should_stop()  # [04] every rank, every step: none may stop alone
        # Always at the end too: under ZeRO-3, model.pt is rebuilt from the last checkpoint.
        save_due = stop or at_end or args.save_every and state.step % args.save_every == 0  # [05]
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
            logits = models.predict(model, images, flip=context.args.tta)  # [05] ZeRO-3 gathers
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(context, state):
    """Everything a resumed run needs to continue as if it had never stopped."""
    # Every rank: barriers inside, and under ZeRO each rank writes its shard (rank 0 alone would
    # hang). The engine saves weights, optimizer and schedule; client_state the rest.
    args, directory = context.args, os.path.join(context.args.output_dir, "checkpoints")  # [05]
    tag = f"step{state.step}"  # [05]
    state.model.save_checkpoint(directory, tag=tag, save_latest=False, client_state={  # [05]
        "scaler": state.scaler.state_dict(),  # [02] the current loss scale
        "epoch": state.epoch,
        "step": state.step,
        "rng": utils.get_rng_state(),
        **utils.resume_settings(args),  # load_checkpoint refuses a resume with others
        "zero_stage": state.model.zero_optimization_stage(),  # [05] another reads other files
    })  # [05]
    # Our `latest`, not DeepSpeed's, which rank 0 writes before the other ranks have finished their
    # shards: after the final barrier, atomically (a crash mid-save leaves the previous one named).
    if context.rank == 0:  # [05]
        utils.commit_checkpoint(directory, tag)  # [05]


def load_checkpoint(context, state):
    """Restore `save_checkpoint`'s state into `state`, and say where the run continues."""
    args, directory = context.args, os.path.join(context.args.output_dir, "checkpoints")  # [05]
    # One clear error, on every rank, before DeepSpeed loads the weights (its docstring says which).
    utils.check_deepspeed_checkpoint(directory, state.model, args)  # [05]
    path, checkpoint = state.model.load_checkpoint(directory)  # [05] each rank reads its shard
    state.scaler.load_state_dict(checkpoint["scaler"])  # [02]
    utils.set_rng_state(checkpoint["rng"])
    state.step, state.epoch = checkpoint["step"], checkpoint["epoch"]
    utils.report_resume(path, checkpoint)


if __name__ == "__main__":
    utils.run(main)
