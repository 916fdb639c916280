"""Step 06: the same loop with Hugging Face Accelerate, on MNIST.

New (relative to step 04; lines marked `# [06]`): an `Accelerator` replaces 04's set-up under any
launcher; `prepare` wraps model, optimizer, schedule and loaders; `backward`, `gather_for_metrics`,
`reduce` and `save_state` do the rest. MNIST and its CNN (common/) replace CIFAR-10.

Launch:
    accelerate launch --config_file accelerate_config.yaml 06_mnist_accelerate.py  # 2 GPUs, fp16
    torchrun --standalone --nproc_per_node=2 06_mnist_accelerate.py --synthetic --epochs 1  # CPU
    python 06_mnist_accelerate.py  # one process: GPU 0 if there is one, else the CPU
"""

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
    flags.add_amp_argument(parser, default=flags.accelerate_launch_amp(),  # [06] the launcher's
                           fp16_cpu_refusal="Accelerate scales fp16 losses on GPUs only")  # [06]
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
    # Moves and wraps the model (DDP, autocast), the optimizer (fp16's scaling); shards the loaders.
    model, optimizer, train_loader, test_loader, scheduler = context.accelerator.prepare(  # [06]
        model, optimizer, train_loader, test_loader, scheduler)  # [06]
    # One seed built the same weights everywhere; from here each process draws its own dropout.
    set_seed(args.seed, device_specific=True)  # [06]
    state = utils.State(model, optimizer, scheduler, last_step)  # [06]

    # Started again (torchrun --max-restarts, a requeued Slurm job)? The ranks decide together.
    if distributed.should_resume(args.resume, args.output_dir, "checkpoint.pt"):  # [04]
        load_checkpoint(context, state)
        if utils.finished(args.output_dir, state.step, last_step):  # run again after its end
            return

    record = utils.RunRecord(__file__, context, len(train_loader), data="mnist")  # [06]
    for epoch in range(state.epoch, args.epochs):  # from the checkpoint's epoch if resumed
        state.epoch = epoch
        train_loader.set_epoch(epoch)  # [06] not the sampler's: the loader would overwrite it
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
        weights = context.accelerator.unwrap_model(model).state_dict()  # [06] no "module."
        utils.write_outputs(args.output_dir, weights, metrics)  # [06]
    context.accelerator.wait_for_everyone()  # [06] leave together, as in 04
    context.accelerator.end_training()  # [06] destroys the process group


def setup(args):
    """What the run is, read by every function below (common/utils.py's Context)."""
    utils.seed_everything(args.seed)
    # The checks before the process group, which `Accelerator` starts (04 says why). No launcher: 1.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))  # [06]
    distributed.require_divisible_batch(args.batch_size, world_size)  # [04] a share per process
    if not args.synthetic:
        data.download_mnist(args.data_dir)  # [06]
    # One object does 04's set-up under any launcher: process group, rank, world size, device.
    accelerator = Accelerator(  # [06]
        cpu=not torch.cuda.is_available(),  # [06] or CPU processes under torchrun each train alone
        mixed_precision="no" if args.amp == "none" else args.amp,  # [06] autocast, fp16's scaling
        # The loaders yield global batches; non_blocking: the CPU does not wait for each copy.
        dataloader_config=DataLoaderConfiguration(split_batches=True, non_blocking=True),  # [06]
        kwargs_handlers=[InitProcessGroupKwargs(timeout=distributed.TIMEOUT)],  # [06] 04's timeout
    )  # [06]
    device = accelerator.device  # [06]
    if device.type == "cuda":  # [02]
        utils.use_deterministic_kernels()  # [02] or --resume drifts from an uninterrupted run
    else:  # [02]
        distributed.print0("no GPU found: training on the CPU")  # [04]
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp],  # [06]
                         accelerator=accelerator)  # [06]


def build_data(context):
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
    train_set, test_set = data.load_mnist(args.data_dir, args.synthetic, seed=args.seed)  # [06]
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set "
                               f"({len(train_set)})")
    # 01's order, in global batches: `prepare` gives each process its share of every batch.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)  # [06]
    # A torch DataLoader, which `prepare` can shard. As in common/data.py's BatchLoader: its own
    # generator (a resumed run draws the same numbers), workers from a forkserver (we run threads).
    workers = dict(data.worker_options(args.num_workers), pin_memory=device.type == "cuda")  # [06]
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,  # [06]
                              generator=torch.Generator().manual_seed(args.seed),  # [06]
                              drop_last=True, **workers)  # [06]
    test_loader = DataLoader(test_set, batch_size=args.batch_size, **workers)  # [06] sharded too
    return train_set, sampler, train_loader, test_loader


def build_model(context):
    """The model (common/models.py), on the run's device, as this step trains it."""
    model = models.MnistCNN(dropout=not context.args.no_dropout)  # [06] `prepare` moves it
    return model


def train_one_epoch(context, state, loader):
    """Train until the end of the epoch or the run's last step; returns the mean loss."""
    args, device, model = context.args, context.device, state.model
    accelerator = context.accelerator  # [06]
    model.train()
    done = state.step - state.epoch * len(loader)  # batches of this epoch trained before a resume
    end = min(len(loader), done + state.last_step - state.step)
    loss_sum = torch.zeros((), device=device)
    # Resuming mid-epoch: a loader that skips the batches already trained without loading them.
    batches = accelerator.skip_first_batches(loader, done) if done else loader  # [06]
    progress = tqdm(itertools.islice(batches, end - done), total=end - done,  # [06]
                    desc=f"epoch {state.epoch + 1}", leave=False, disable=context.rank != 0)  # [04]
    for images, labels in progress:
        loss = F.cross_entropy(model(images), labels)  # [06] autocast is in the model
        state.optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)  # [06] instead of loss.backward(): scales the loss for fp16
        # The wrapped optimizer unscales, and skips the step if fp16 gradients overflowed.
        state.optimizer.step()  # [06]
        state.scheduler.step()
        state.step += 1
        loss_sum += loss.detach()
        at_end = state.step == state.last_step
        stop = distributed.should_stop()  # [04] every rank, every step: none may stop alone
        save_due = stop or args.save_every and (state.step % args.save_every == 0 or at_end)  # [04]
        # Reading the loss waits for the step to finish: every 10 steps, at the end, before a save.
        if state.step % 10 == 0 or at_end or save_due:
            logged_loss = accelerator.reduce(loss.detach(), "mean").item()  # [06] on every rank
            utils.check_finite(logged_loss, state.step)  # a diverged run stops before it saves NaNs
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if save_due:
            save_checkpoint(context, state)
        if stop:  # [04] every rank stops after this step, saved: exit status 75
            raise utils.Preempted(state.step, args.output_dir)  # [04]
    return accelerator.reduce(loss_sum, "mean").item() / max(end - done, 1)  # [06]


@torch.no_grad()
def evaluate(context, model, loader):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    device = context.device
    model.eval()
    # The loss sum, the correct predictions, the samples.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        logits = model(images)  # [06]
        # Every process's results, less the samples that `prepare` repeated to give each process a
        # full last batch: every rank then counts each test sample once, at any world size.
        logits, labels = context.accelerator.gather_for_metrics((logits, labels))  # [06]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(context, state):
    """Everything a resumed run needs to continue as if it had never stopped."""
    # Every process: the main one writes model, optimizer and schedule; each its random state.
    args, directory = context.args, os.path.join(context.args.output_dir, "checkpoints")  # [06]
    context.accelerator.save_state(os.path.join(directory, f"step{state.step}"))  # [06]
    context.accelerator.wait_for_everyone()  # [06] all files complete before checkpoint.pt names it
    if context.rank != 0:  # [04] what follows is the same on every rank: one writer
        return  # [04]
    # save_state fills a directory, not atomically: checkpoint.pt, written atomically after it, says
    # which step the newest complete one holds. The older directories go.
    utils.save_atomic({
        "epoch": state.epoch,
        "step": state.step,
        **utils.resume_settings(args),  # load_checkpoint refuses a resume with others
        "world_size": context.world_size,  # [06] one random state per process
    }, os.path.join(args.output_dir, "checkpoint.pt"))
    utils.remove_other_checkpoints(directory, keep=f"step{state.step}")  # [06]


def load_checkpoint(context, state):
    """Restore `save_checkpoint`'s state into `state`, and say where the run continues."""
    args, path = context.args, os.path.join(context.args.output_dir, "checkpoint.pt")
    checkpoint = utils.load_checkpoint(path, map_location=context.device)
    utils.check_resumable(path, checkpoint, **utils.resume_settings(args),  # [06]
                          world_size=context.world_size)  # [06]
    step = f"step{checkpoint['step']}"  # [06]
    context.accelerator.load_state(os.path.join(args.output_dir, "checkpoints", step))  # [06]
    state.step, state.epoch = checkpoint["step"], checkpoint["epoch"]
    utils.report_resume(path, checkpoint)


if __name__ == "__main__":
    utils.run(main)
