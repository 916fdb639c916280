"""Step 03: one process, every GPU of the machine, with `nn.DataParallel`.

New (relative to step 02; lines marked `# [03]`): `nn.DataParallel` wraps the model. Each forward
pass splits the batch across the visible GPUs, runs a replica of the model on each (threads of this
one process) and gathers the outputs on GPU 0, where the loss is computed; backward sums the
gradients onto GPU 0's weights. The wrapper keeps the model in `.module`: that is what gets saved.
DataParallel is the shortest path to many GPUs, not the fast one (docs/dataparallel-vs-ddp.md): step
04 is what PyTorch recommends. Without a GPU it runs on the CPU.

Launch:
    python 03_cifar10_dataparallel.py --amp fp16             # every visible GPU
    CUDA_VISIBLE_DEVICES=0,1 python 03_cifar10_dataparallel.py   # a chosen subset
    python 03_cifar10_dataparallel.py --synthetic --epochs 1  # generated stand-in data, offline
"""

import os

import torch
import torch.nn.functional as F
from torch import nn  # [03]
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, flags, models, utils


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    flags.add_amp_argument(parser)  # [02]
    return parser.parse_args()


def main():
    args = parse_args()
    context = setup(args)
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

    if args.resume:
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
    # The weights are in model.module; saving the wrapper would prefix every key with "module.".
    utils.write_outputs(args.output_dir, model.module.state_dict(), metrics)  # [03]


def setup(args):
    """What the run is, read by every function below (common/utils.py's Context)."""
    utils.seed_everything(args.seed)
    # DataParallel's replica threads inherit autocast's on/off switch but not its dtype (which is
    # thread-local), so bf16 would silently run as fp16 without a scaler.
    if args.amp == "bf16" and torch.cuda.device_count() > 1:  # [03]
        raise utils.UsageError("--amp bf16 does not reach DataParallel's replicas; "  # [03]
                               "use --amp fp16 or step 04")  # [03]
    if not args.synthetic:
        data.download_cifar10(args.data_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # [02]
    if device.type == "cuda":  # [02]
        utils.use_deterministic_kernels()  # [02] or --resume drifts from an uninterrupted run
    else:  # [02]
        print("no GPU found: training on the CPU")  # [02]
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp])  # [02] None: fp32


def build_data(context):
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set "
                               f"({len(train_set)})")
    # One order per seed and epoch; from 04 on, each replica keeps every replicas-th sample of it.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)
    # Whole batches, cut and augmented on `device` in a few tensor ops (docs/data-and-model.md).
    train_loader = data.BatchLoader(train_set, args.batch_size, sampler=sampler, drop_last=True,
                                    device=device, num_workers=args.num_workers)
    test_loader = data.BatchLoader(test_set, args.batch_size, device=device,
                                   num_workers=args.num_workers)
    return train_set, sampler, train_loader, test_loader


def build_model(context):
    """The model (common/models.py), on the run's device, as this step trains it."""
    model = models.build(context.args).to(context.device)
    model = nn.DataParallel(model)  # [03] copies itself onto every visible GPU at each forward
    print(f"DataParallel over {max(torch.cuda.device_count(), 1)} device(s)")  # [03]
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
                    desc=f"epoch {state.epoch + 1}", leave=False)
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
        save_due = args.save_every and (state.step % args.save_every == 0 or at_end)
        # Reading the loss waits for the step to finish: every 10 steps, at the end, before a save.
        if state.step % 10 == 0 or at_end or save_due:
            logged_loss = loss.item()
            utils.check_finite(logged_loss, state.step)  # a diverged run stops before it saves NaNs
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if save_due:
            save_checkpoint(context, state)
    return loss_sum.item() / max(end - done, 1)


@torch.no_grad()
def evaluate(context, model, loader):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    device = context.device
    amp_dtype = context.amp_dtype  # [02]
    model.eval()
    # The loss sum, the correct predictions, the samples.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            logits = models.predict(model, images, flip=context.args.tta)  # [02]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(context, state):
    """Everything a resumed run needs to continue as if it had never stopped."""
    args = context.args
    utils.save_atomic({
        "model": state.model.module.state_dict(),  # [03]
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
    state.model.module.load_state_dict(checkpoint["model"])  # [03]
    state.optimizer.load_state_dict(checkpoint["optimizer"])
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    state.scaler.load_state_dict(checkpoint["scaler"])  # [02]
    utils.set_rng_state(checkpoint["rng"])
    state.step, state.epoch = checkpoint["step"], checkpoint["epoch"]
    utils.report_resume(path, checkpoint)


if __name__ == "__main__":
    utils.run(main)
