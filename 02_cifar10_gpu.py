"""Step 02: the same loop on one GPU, with mixed precision.

New (lines marked `# [02]`): `device` is the GPU, so the model and every batch go there (the loader
copies each batch as uint8 from pinned memory and augments it on the GPU), --amp runs the forward pass
under `torch.autocast` (fp16 with a `GradScaler`), and deterministic kernels keep --resume exact.
Without a GPU it runs on the CPU.

Launch:
    python 02_cifar10_gpu.py --amp bf16               # CIFAR-10 on GPU 0 (fp16 on pre-Ampere GPUs)
    python 02_cifar10_gpu.py --synthetic --epochs 1   # generated stand-in data, offline

Next: 03_cifar10_dataparallel.py uses every GPU of the machine from this one process.
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
    flags.add_amp_argument(parser)  # [02]
    return parser.parse_args()


def main():
    args = parse_args()
    utils.seed_everything(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # [02]
    if device.type == "cuda":  # [02]
        utils.use_deterministic_kernels()  # [02] or --resume drifts from an uninterrupted run
    else:  # [02]
        print("no GPU found: training on the CPU")  # [02]
    amp_dtype = flags.AMP_DTYPES[args.amp]  # [02] None: plain fp32

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
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")  # [02] fp16: small gradients would underflow

    step, start_epoch = 0, 0
    if args.resume:
        step, start_epoch = load_checkpoint(args, model, optimizer, scheduler, scaler, device)  # [02]
        if utils.finished(args.output_dir, step, last_step):  # run again after its end: rank 0 decides for all
            return

    record = utils.RunRecord(__file__, args, len(train_loader), device, amp=args.amp)  # [02]
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training()
        train_loss, new_step = train_one_epoch(args, model, train_loader, optimizer, scheduler,
                                               scaler, amp_dtype, device, epoch, step, last_step)  # [02]
        record.stop_training((new_step - step) * args.batch_size)
        step = new_step
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device, amp_dtype, args.tta)  # [02]
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = record.metrics()
    utils.save_atomic(model.state_dict(), os.path.join(args.output_dir, "model.pt"))
    utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))


def train_one_epoch(args, model, loader, optimizer, scheduler,
                    scaler, amp_dtype, device, epoch, step, last_step):  # [02]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {epoch + 1}", leave=False)
    for images, labels in progress:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            loss = F.cross_entropy(model(images), labels, label_smoothing=args.label_smoothing)  # [02]
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # [02]
        scaler.step(optimizer)  # [02] unscales the gradients; skips the step if they overflowed
        scaler.update()  # [02]
        scheduler.step()
        step += 1
        loss_sum += loss.detach()
        checkpoint_due = args.save_every and (step % args.save_every == 0 or step == last_step)
        if step % 10 == 0 or step == last_step or checkpoint_due:  # reading the loss waits for the step to finish
            logged_loss = loss.item()
            utils.check_finite(logged_loss, step)  # a diverged run stops here, before it saves its NaN weights
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if checkpoint_due:
            save_checkpoint(args, model, optimizer, scheduler, scaler, epoch, step)  # [02]
    return loss_sum.item() / max(end - done, 1), step


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype, tta):  # [02]
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):  # [02]
            logits = models.predict(model, images, flip=tta)  # [02]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, model, optimizer, scheduler, scaler, epoch, step):  # [02]
    """Everything a resumed run needs to continue as if it had never stopped."""
    utils.save_atomic({
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "scaler": scaler.state_dict(),  # [02] the current loss scale
        "epoch": epoch,
        "step": step,
        "rng": utils.get_rng_state(),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
        "width": args.width,
    }, os.path.join(args.output_dir, "checkpoint.pt"))


def load_checkpoint(args, model, optimizer, scheduler, scaler, device):  # [02]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    path = os.path.join(args.output_dir, "checkpoint.pt")
    checkpoint = utils.load_checkpoint(path, map_location=device)
    utils.check_resumable(path, checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          width=args.width)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    scaler.load_state_dict(checkpoint["scaler"])  # [02]
    utils.set_rng_state(checkpoint["rng"])
    utils.report_resume(path, checkpoint)
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main)
