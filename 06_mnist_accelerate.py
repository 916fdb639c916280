"""Step 06: the same loop with Hugging Face Accelerate, on MNIST.

New (relative to step 04; lines marked `# [06]`): an `Accelerator` replaces 04's set-up under any
launcher; `prepare` wraps model, optimizer and schedule and shards the loaders; `backward`,
`gather_for_metrics`, `reduce` and `save_state` do the rest. MNIST and its CNN (common/) replace CIFAR-10.

Launch:
    accelerate launch --config_file accelerate_config.yaml 06_mnist_accelerate.py   # 2 GPUs, fp16
    accelerate launch --config_file accelerate_config.yaml --mixed_precision no 06_mnist_accelerate.py  # CPU
    torchrun --standalone --nproc_per_node=2 06_mnist_accelerate.py --synthetic --epochs 1   # CPU, offline
    python 06_mnist_accelerate.py                      # one process: GPU 0 if there is one, else the CPU
"""

import datetime  # [04]
import itertools  # [06]
import os

import torch
import torch.nn.functional as F
from accelerate import Accelerator  # [06]
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs, set_seed  # [06]
from torch.utils.data import DataLoader, DistributedSampler  # [06]
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_dropout_argument(parser)  # [06]
    flags.add_amp_argument(parser, default=flags.accelerate_launch_amp(),  # [06] the launcher's, unless given
                           fp16_cpu_refusal="Accelerate scales fp16 losses on GPUs only")  # [06]
    return parser.parse_args()


def main():
    args = parse_args()
    # SIGTERM or SIGUSR1 (preemption, a time limit near): stop at a step that all ranks agree on, saved.
    preemption = distributed.Preemption()  # [04] before anything slow: the default action would kill the process
    utils.seed_everything(args.seed)
    # Every check of the input before the process group, which `Accelerator` starts (04 says why). The launcher
    # sets WORLD_SIZE; plain `python` is a world of one.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # [06]
    if args.batch_size % world_size:  # [06] --batch-size is global: each process takes an equal share
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible "  # [06]
                               f"by the world size {world_size}")  # [06]
    # Before the process group, whose timeout a slow download would outlast (one process per machine downloads).
    if not args.synthetic:  # [06]
        data.download_mnist(args.data_dir)  # [06]
    train_set, test_set = data.load_mnist(args.data_dir, args.synthetic, seed=args.seed)  # [06]
    if args.batch_size > len(train_set):  # [06]
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set "  # [06]
                               f"({len(train_set)})")  # [06]
    # One object does 04's set-up under any launcher: process group, rank, world size, device.
    accelerator = Accelerator(  # [06]
        cpu=not torch.cuda.is_available(),  # [06] without it, CPU processes under torchrun would each train alone
        mixed_precision="no" if args.amp == "none" else args.amp,  # [06] autocast, and fp16's loss scaling
        # The loaders yield global batches; non_blocking: the CPU does not wait for each copy from pinned memory.
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),  # [06]
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=5))],  # [06] 04's short timeout
    )  # [06]
    rank, device = accelerator.process_index, accelerator.device  # [06]
    preemption.connect()  # [06] its gloo group, now: a network that gloo cannot use fails here, not at step 1
    if device.type == "cuda":  # [02]
        utils.use_deterministic_kernels()  # [02] or --resume drifts from an uninterrupted run
    else:  # [02]
        distributed.print0("no GPU found: training on the CPU")  # [04]

    # 01's order, in global batches: `prepare` gives each process its share of every batch.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)  # [06]
    # A torch DataLoader, which `prepare` can shard. Its own generator: otherwise each epoch's iterator
    # draws a seed from the global RNG, and a resumed run's random numbers would not match an uninterrupted run's.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,  # [06]
                              generator=torch.Generator().manual_seed(args.seed),  # [06]
                              num_workers=args.num_workers, pin_memory=device.type == "cuda")  # [06] see non_blocking
    test_loader = DataLoader(test_set, batch_size=args.batch_size,  # [06] a plain loader: `prepare` shards it
                             num_workers=args.num_workers, pin_memory=device.type == "cuda")  # [06]

    model = models.MnistCNN(dropout=not args.no_dropout)  # [06]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    # Moves the model to the device and wraps it (DDP, autocast), the optimizer (fp16 loss scaling) and loaders.
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(  # [06]
        model, optimizer, train_loader, test_loader, scheduler)  # [06]
    # One seed built the same weights everywhere; from here on each process draws its own dropout masks.
    set_seed(args.seed, device_specific=True)  # [06] seed + process index, for Python, NumPy, torch and the GPUs

    step, start_epoch = 0, 0
    # Started again (torchrun --max-restarts=K after a failure, a requeued Slurm job): go on from the last checkpoint.
    # Rank 0 decides, for every rank: a rank that cannot see the checkpoint stops the job with one error.
    if distributed.should_resume(args.resume, os.path.join(args.output_dir, "checkpoint.pt")):  # [04]
        step, start_epoch = load_checkpoint(args, accelerator, device)  # [06]
        if utils.finished(args.output_dir, step, last_step):  # run again after its end: rank 0 decides for all
            return

    record = utils.RunRecord(__file__, args, len(train_loader), device, data="mnist", amp=args.amp,  # [06]
                             world_size=world_size)  # [06]
    for epoch in range(start_epoch, args.epochs):
        train_loader.set_epoch(epoch)  # [06] not sampler.set_epoch: the prepared loader would overwrite it
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training()
        train_loss, new_step = train_one_epoch(args, model, train_loader, optimizer, scheduler,
                                               accelerator, device, epoch, step, last_step, preemption)  # [06]
        record.stop_training((new_step - step) * args.batch_size)
        step = new_step
        if preemption.stopped:  # [04] every rank stopped after this step, once the checkpoint was written
            raise utils.Preempted(preemption, step, args.output_dir)  # [04] exit status 75: continue with --resume
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device, accelerator)  # [06]
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = record.metrics()
    if rank == 0:  # [04] one writer. No collective in here: the other ranks would never join it.
        # unwrap_model takes the wrappers off: a plain state_dict, without "module." prefixes.
        state_dict = accelerator.unwrap_model(model).state_dict()  # [06]
        utils.save_atomic(state_dict, os.path.join(args.output_dir, "model.pt"))  # [06]
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))  # [04]
    # Leave together: a gloo rank that tears down its connections while rank 0 is still writing can abort.
    accelerator.wait_for_everyone()  # [06]
    accelerator.end_training()  # [06] destroys the process group


def train_one_epoch(args, model, loader, optimizer, scheduler,
                    accelerator, device, epoch, step, last_step, preemption):  # [06]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=device)
    # Resuming mid-epoch: a loader that skips the batches already trained without loading them.
    batches = accelerator.skip_first_batches(loader, done) if done else loader  # [06]
    progress = tqdm(itertools.islice(batches, end - done), total=end - done,  # [06]
                    desc=f"epoch {epoch + 1}", leave=False, disable=not accelerator.is_main_process)  # [06]
    for images, labels in progress:
        loss = F.cross_entropy(model(images), labels)  # [06] already on the device; autocast is in the model
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)  # [06] instead of loss.backward(): scales the loss for fp16
        optimizer.step()  # [06] the wrapped optimizer unscales, and skips the step if fp16 gradients overflowed
        scheduler.step()
        step += 1
        loss_sum += loss.detach()
        # Every rank asks at every step: a rank that stopped alone would leave the others waiting in a collective.
        stop = preemption.should_stop()  # [04] True on all ranks at the same step if any was signalled
        checkpoint_due = stop or args.save_every and (step % args.save_every == 0 or step == last_step)  # [04]
        if step % 10 == 0 or step == last_step or checkpoint_due:  # reading the loss waits for the step to finish
            # Every rank runs the all-reduce, not rank 0 alone: a diverged run stops on all at the same step.
            logged_loss = accelerator.reduce(loss.detach(), "mean").item()  # [06]
            utils.check_finite(logged_loss, step)  # a diverged run stops here, before it saves its NaN weights
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if checkpoint_due:  # [06] on every process
            save_checkpoint(args, accelerator, epoch, step)  # [06]
        if stop:  # [04]
            break  # [04]
    return accelerator.reduce(loss_sum, "mean").item() / max(end - done, 1), step  # [06]


@torch.no_grad()
def evaluate(model, loader, device, accelerator):  # [06]
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        logits = model(images)  # [06]
        # Every process's results, less the samples that `prepare` repeated to give each process a full
        # last batch: every rank then counts each test sample once, at any world size.
        logits, labels = accelerator.gather_for_metrics((logits, labels))  # [06]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, accelerator, epoch, step):  # [06]
    """Everything a resumed run needs to continue as if it had never stopped."""
    # On every process: the main one writes model, optimizer and schedule; each its random state and the scale.
    directory = os.path.join(args.output_dir, "checkpoints", f"step{step}")  # [06]
    accelerator.save_state(directory)  # [06]
    accelerator.wait_for_everyone()  # [06] every file complete before checkpoint.pt names the directory
    if not accelerator.is_main_process:  # [06]
        return  # [06]
    # save_state fills a directory, not atomically: checkpoint.pt, written atomically after it, says which
    # step the newest complete one holds. The older directories go.
    utils.save_atomic({
        "epoch": epoch,
        "step": step,
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "world_size": accelerator.num_processes,  # [06] one random state per process
    }, os.path.join(args.output_dir, "checkpoint.pt"))
    utils.remove_other_checkpoints(os.path.dirname(directory), keep=f"step{step}")  # [06]


def load_checkpoint(args, accelerator, device):  # [06]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    path = os.path.join(args.output_dir, "checkpoint.pt")
    checkpoint = utils.load_checkpoint(path, map_location=device)
    utils.check_resumable(path, checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          world_size=accelerator.num_processes)  # [06]
    accelerator.load_state(os.path.join(args.output_dir, "checkpoints", f"step{checkpoint['step']}"))  # [06]
    utils.report_resume(path, checkpoint)
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)  # [04] gloo threads would abort Python's shutdown (see utils.run)
