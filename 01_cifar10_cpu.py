"""Step 01: the plain PyTorch training loop, on the CPU.

Trains ResNet-9 (common/models.py) on CIFAR-10: shuffle, augment, forward, loss, backward, step.
Evaluates after every epoch, writes the final weights and metrics, and with --save-every writes
a checkpoint that --resume continues exactly, even from the middle of an epoch.

Launch:
    python 01_cifar10_cpu.py                          # CIFAR-10, downloaded into ./data
    python 01_cifar10_cpu.py --synthetic --epochs 1   # generated stand-in data, offline

Next: 02_cifar10_gpu.py runs the same loop on a GPU, with mixed precision.
"""

import os

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, flags, models, utils


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_cifar10_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    utils.seed_everything(args.seed)
    device = torch.device("cpu")

    if not args.synthetic:
        data.download_cifar10(args.data_dir)
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    # One process, the order that 04 splits between ranks: step i trains on the same samples at any world size.
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=args.seed)
    # Whole batches, cut and augmented on `device` in a few tensor operations (docs/data-and-model.md).
    train_loader = data.BatchLoader(train_set, args.batch_size, sampler=sampler, drop_last=True,
                                    device=device, num_workers=args.num_workers)
    test_loader = data.BatchLoader(test_set, args.batch_size, device=device, num_workers=args.num_workers)

    model = models.ResNet9(norm=args.norm, width=args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps

    step, start_epoch = 0, 0
    if args.resume:
        step, start_epoch = load_checkpoint(args, model, optimizer, scheduler, device)
        if utils.finished(args.output_dir, step, last_step):  # run again after its end: rank 0 decides for all
            return

    record = utils.RunRecord(__file__, args, len(train_loader), device)
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training()
        train_loss, new_step = train_one_epoch(args, model, train_loader, optimizer, scheduler,
                                               device, epoch, step, last_step)
        record.stop_training((new_step - step) * args.batch_size)
        step = new_step
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device, args.tta)
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = record.metrics()
    utils.save_atomic(model.state_dict(), os.path.join(args.output_dir, "model.pt"))
    utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))


def train_one_epoch(args, model, loader, optimizer, scheduler,
                    device, epoch, step, last_step):
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {epoch + 1}", leave=False)
    for images, labels in progress:
        loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        step += 1
        loss_sum += loss.detach()
        checkpoint_due = args.save_every and (step % args.save_every == 0 or step == last_step)
        if step % 10 == 0 or step == last_step or checkpoint_due:  # reading the loss waits for the step to finish
            logged_loss = loss.item()
            utils.check_finite(logged_loss, step)  # a diverged run stops here, before it saves its NaN weights
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if checkpoint_due:
            save_checkpoint(args, model, optimizer, scheduler, epoch, step)
    return loss_sum.item() / max(end - done, 1), step


@torch.no_grad()
def evaluate(model, loader, device, tta):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        logits = models.predict(model, images, flip=tta)
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, model, optimizer, scheduler, epoch, step):
    """Everything a resumed run needs to continue as if it had never stopped."""
    utils.save_atomic({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "epoch": epoch,
        "step": step,
        "rng": utils.get_rng_state(),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "width": args.width,
    }, os.path.join(args.output_dir, "checkpoint.pt"))


def load_checkpoint(args, model, optimizer, scheduler, device):
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    path = os.path.join(args.output_dir, "checkpoint.pt")
    checkpoint = utils.load_checkpoint(path, map_location=device)
    utils.check_resumable(path, checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          width=args.width)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    utils.set_rng_state(checkpoint["rng"])
    utils.report_resume(path, checkpoint)
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main)
