"""Step 05: the same processes, with the DeepSpeed engine: ZeRO, mixed precision, ds_config.json.

New (relative to step 04; lines marked `# [05]`): `deepspeed.initialize` wraps 04's model, optimizer
and schedule in an engine that averages the gradients (summed over --gradient_accumulation_steps
micro-batches), runs fp16 or bf16, partitions the optimizer state, the gradients and the weights
across the processes (ZeRO stages 1-3), and checkpoints a shard per rank. The loop stays ours:
`model.backward(loss)`, `model.step()`. ds_config.json holds the settings; the command line wins.

Launch:
    deepspeed --num_gpus=N 05_cifar10_deepspeed.py --amp bf16            # N GPUs on this machine
    torchrun --nproc_per_node=N 05_cifar10_deepspeed.py --zero-stage 3     # the same, started by torchrun
    OMP_NUM_THREADS=1 deepspeed --num_gpus=2 05_cifar10_deepspeed.py --synthetic --epochs 1  # no GPU: gloo
Without GPUs --num_gpus is the number of processes, and the first run compiles a small op with the
environment's ninja (activate it). Several machines, hostfiles, ssh: docs/deepspeed.md.

Next: 06_mnist_accelerate.py writes the loop once for any launcher, with Accelerate.
"""

import datetime  # [04]
import os

import deepspeed  # [05]
import torch
import torch.distributed as dist  # [04]
import torch.nn.functional as F
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # [05]
from torch.utils.data import DistributedSampler, Subset  # [04]
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser, fp16_cpu_refusal="05 runs DeepSpeed's fp16 on GPUs only")  # [05]
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="default: the config's")  # [05]
    parser.add_argument("--gradient_accumulation_steps", "--gradient-accumulation-steps", metavar="N",  # [05]
                        type=flags.positive_int, help="micro-batches per optimizer step (default: the config)")  # [05]
    parser.add_argument("--deepspeed-config", default=os.path.join(os.path.dirname(__file__), "ds_config.json"),  # [05]
                        help="DeepSpeed's settings (default: ds_config.json beside this script)")  # [05]
    return parser.parse_args()


def main():
    args = parse_args()
    # SIGTERM or SIGUSR1 (preemption, a time limit near): stop at a step that all ranks agree on, saved.
    preemption = distributed.Preemption()  # [04] before anything slow: the default action would kill the process
    utils.seed_everything(args.seed)
    config = utils.read_json(args.deepspeed_config, "--deepspeed-config")  # [05]
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
    accumulation_steps = args.gradient_accumulation_steps or config.get("gradient_accumulation_steps", 1)  # [05]
    if batch_size % accumulation_steps:  # [05] --batch-size stays global: each process's share is N micro-batches
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by the world size "  # [05]
                               f"{world_size} times --gradient_accumulation_steps {accumulation_steps}")  # [05]
    batch_size //= accumulation_steps  # [05] the micro-batch: one forward and backward pass on one process

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
    # Under ZeRO-3 every forward pass gathers the weights from every rank, so every rank must run as many
    # test batches as the others: each slice is cut into the same number of batches.
    test_batches = data.equal_batches(len(test_set), world_size, rank, batch_size)  # [05]
    test_loader = data.BatchLoader(test_shard, batch_sampler=test_batches, device=device,  # [05]
                                   num_workers=args.num_workers)  # [05]

    # After the checks of the input: a rank that stopped on bad input while the others connect would
    # break their connections, and they would fail with a traceback instead of its one error line.
    # 5 minutes, not gloo's 30 (NCCL's 10): a job whose rank died fails soon. device_id: NCCL joins its GPU now.
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5),  # [04]
                            device_id=torch.device("cuda", local_rank) if device.type == "cuda" else None)  # [04]
    preemption.connect()  # [04] its gloo group, now: a network that gloo cannot use fails here, not at step 1

    model = models.ResNet9(norm=args.norm, width=args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    # A last incomplete group of N micro-batches is left out: the engine would add it to the next epoch's first step.
    steps_per_epoch = len(train_loader) // accumulation_steps  # [05] the loader yields micro-batches, N per step
    total_steps = args.epochs * steps_per_epoch  # [05] optimizer steps, as the engine steps the schedule
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    # The command line wins where it and ds_config.json both speak. --batch-size stays the global batch
    # (DeepSpeed checks train_batch_size = micro batch x gradient accumulation steps x world size).
    config.update(train_batch_size=args.batch_size, train_micro_batch_size_per_gpu=batch_size,  # [05]
                  gradient_accumulation_steps=accumulation_steps)  # [05]
    # torch.autocast, not DeepSpeed's "bf16" and "fp16", which cast the parameters (BatchNorm's too) to 16
    # bits. The engine runs its forward pass in the config's autocast, and would turn ours off without it.
    if amp_dtype is not None:  # [05]
        config["torch_autocast"] = {"enabled": True, "dtype": args.amp}  # [05] fp16: a torch GradScaler
    if args.zero_stage is not None:  # [05]
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage  # [05]
    # The engine broadcasts rank 0's weights, wraps the optimizer (for ZeRO and 16 bits), averages the
    # gradients in backward, steps the schedule after each optimizer step and keeps both in its checkpoints.
    model, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,  # [05]
                                          config=config)  # [05] the loop calls only the engine
    distributed.remove_deepspeed_shared_memory()  # [05] CPU, deepspeed launcher: or 69 MB per rank stay in /dev/shm

    step, start_epoch = 0, 0
    # Started again (torchrun --max-restarts=K after a failure, a requeued Slurm job): go on from the last checkpoint.
    # Rank 0 decides, for every rank: a rank that cannot see the checkpoint stops the job with one error.
    if distributed.should_resume(args.resume, os.path.join(args.output_dir, "checkpoints", "latest")):  # [05]
        step, start_epoch = load_checkpoint(args, model)  # [05]
        if utils.finished(args.output_dir, step, last_step):  # run again after its end: rank 0 decides for all
            return

    record = utils.RunRecord(__file__, args, steps_per_epoch, device, amp=args.amp, world_size=world_size,  # [05]
                             zero_stage=model.zero_optimization_stage())  # [05]
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # [04] without it, DistributedSampler repeats epoch 0's order forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training()
        train_loss, new_step = train_one_epoch(args, model, train_loader, accumulation_steps, steps_per_epoch,  # [05]
                                               amp_dtype, device, epoch, step, last_step, preemption)  # [05]
        record.stop_training((new_step - step) * args.batch_size)
        step = new_step
        if preemption.stopped:  # [04] every rank stopped after this step, once the checkpoint was written
            raise utils.Preempted(preemption, step, args.output_dir)  # [04] exit status 75: continue with --resume
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device, amp_dtype, args.tta)  # [02]
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = record.metrics()
    if rank == 0:  # [04] one writer. No collective in here: the other ranks would never join it.
        # Under ZeRO-3 each rank holds a shard of the weights only: DeepSpeed's zero_to_fp32, its offline
        # converter, reassembles them from the final checkpoint. The weights stay fp32 under --amp.
        if model.zero_optimization_stage() == 3:  # [05]
            state_dict = get_fp32_state_dict_from_zero_checkpoint(os.path.join(args.output_dir, "checkpoints"))  # [05]
        else:  # [05] ZeRO-0 to 2: every rank holds the whole model, in model.module
            state_dict = model.module.state_dict()  # [05]
        utils.save_atomic(state_dict, os.path.join(args.output_dir, "model.pt"))  # [05]
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))  # [04]
    # Leave together: a gloo rank that tears down its connections while rank 0 is still writing can abort.
    dist.barrier()  # [04]
    dist.destroy_process_group()  # [04]


def train_one_epoch(args, model, loader, accumulation_steps, steps_per_epoch,  # [05]
                    amp_dtype, device, epoch, step, last_step, preemption):  # [05]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = (step - epoch * steps_per_epoch) * accumulation_steps  # [05] micro-batches trained (resuming mid-epoch)
    end = min(steps_per_epoch * accumulation_steps, done + (last_step - step) * accumulation_steps)  # [05]
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {epoch + 1}", leave=False, disable=dist.get_rank() != 0)  # [04]
    for images, labels in progress:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)  # [02]
        boundary = model.is_gradient_accumulation_boundary()  # [05] the Nth micro-batch? Ask before step() counts it
        model.backward(loss)  # [05] scales the loss by 1/N (and for fp16), adds to the gradients, averages them
        model.step()  # [05] at the Nth: optimizer step (skipped if fp16 overflowed), schedule, zero_grad
        loss_sum += loss.detach()  # [05] every micro-batch's loss: the mean is over all of them
        if not boundary:  # [05] the first N-1 micro-batches of a step only add up gradients: no step to count
            continue  # [05]
        step += 1
        # Every rank asks at every step: a rank that stopped alone would leave the others waiting in a collective.
        stop = preemption.should_stop()  # [04] True on all ranks at the same step if any was signalled
        checkpoint_due = stop or step == last_step or args.save_every and step % args.save_every == 0  # [05]
        if step % 10 == 0 or step == last_step or checkpoint_due:  # reading the loss waits for the step to finish
            # Every rank runs the all-reduce, not rank 0 alone: a diverged run stops on all at the same step.
            logged_loss = distributed.all_reduce_mean(loss).item()  # [04]
            utils.check_finite(logged_loss, step)  # a diverged run stops here, before it saves its NaN weights
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        # Every rank saves, its own shard. Always at the end: under ZeRO-3, model.pt is rebuilt from it.
        if checkpoint_due:  # [05]
            save_checkpoint(args, model, epoch, step)  # [05]
        if stop:  # [04]
            break  # [04]
    return distributed.all_reduce_mean(loss_sum).item() / max(end - done, 1), step  # [04]


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, tta):  # [02]
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    # DeepSpeed never synchronises buffers: each rank's BatchNorm statistics have followed its own batches.
    # Evaluate with rank 0's everywhere, the ones that model.pt keeps.
    distributed.broadcast_buffers(model.module)  # [04]
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            logits = models.predict(model, images, flip=tta)  # [05] the engine: under ZeRO-3 it gathers the weights
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, model, epoch, step):  # [05]
    """Everything a resumed run needs to continue as if it had never stopped."""
    # Every rank must call this: each writes its own shard of the optimizer state (under ZeRO-3 also of
    # the weights), with barriers inside. Called by rank 0 alone, it would hang; shards would be lost.
    # The engine saves the weights, optimizer, schedule and loss scale; the client state is the rest.
    directory = os.path.join(args.output_dir, "checkpoints")  # [05]
    model.save_checkpoint(directory, tag=f"step{step}", save_latest=False, client_state={  # [05]
        "epoch": epoch,
        "step": step,
        "rng": utils.get_rng_state(),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "width": args.width,
    })  # [05]
    # `latest` names the checkpoint to resume from. DeepSpeed's own is written by rank 0 before the
    # other ranks have finished their shards, and not atomically: this one is written after
    # save_checkpoint's final barrier, atomically, so a crash mid-save leaves it naming the previous one.
    if dist.get_rank() == 0:  # [05]
        utils.write_text(f"step{step}", os.path.join(directory, "latest"))  # [05]
        utils.remove_other_checkpoints(directory, keep=f"step{step}")  # [05]


def load_checkpoint(args, model):  # [05]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    directory = os.path.join(args.output_dir, "checkpoints")  # [05]
    # One clear error, the same on every rank, for no checkpoint or shards written by another world size.
    utils.check_zero_shards(directory, dist.get_world_size())  # [05] see its docstring
    path, checkpoint = model.load_checkpoint(directory)  # [05] every rank reads its own shard of `latest`
    utils.check_resumable(path, checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          width=args.width)
    utils.set_rng_state(checkpoint["rng"])
    utils.report_resume(path, checkpoint)
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)  # [04] gloo threads would abort Python's shutdown (see utils.run)
