"""Step 06: Hugging Face Accelerate: the same loop on a CPU, one GPU, many GPUs or many machines.

New (relative to step 04; lines marked `# [06]`): an `Accelerator` replaces the hand-written
distributed set-up. It reads the launcher's environment (torchrun, `accelerate launch`, or none:
one process), joins the process group and picks the device. `accelerator.prepare` moves the model
to that device and wraps it for data parallelism, and gives each process its share of every global
batch, already on the device; `accelerator.backward` scales the loss for fp16; `gather_for_metrics`
collects every process's evaluation results, each test sample exactly once; `save_state` and
`load_state` checkpoint everything, each process's random state included. No `.to(device)`, no
process-group code and no branch for one launcher or another is left in the loop. The data set
changes too: MNIST and the small CNN of PyTorch's MNIST example (common/), with AdamW and a StepLR
schedule. The device and precision come from the launcher: `accelerate_config.yaml` says two GPUs
in fp16; an explicit --amp wins.

Launch:
    accelerate launch --config_file accelerate_config.yaml 06_mnist_accelerate.py   # 2 GPUs, fp16
    accelerate launch --config_file accelerate_config.yaml --mixed_precision no \\
        06_mnist_accelerate.py                         # the same config on a CPU machine: 2 processes, gloo
    torchrun --nproc_per_node=2 06_mnist_accelerate.py --synthetic --epochs 1   # CPU (gloo), offline
    python 06_mnist_accelerate.py                      # one process: GPU 0 if there is one, else the CPU
"""

import datetime  # [04]
import os
import shutil  # [06]
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator  # [06]
from accelerate.utils import DataLoaderConfiguration, InitProcessGroupKwargs  # [06]
from torch.utils.data import DataLoader
from tqdm import tqdm

from common import data, flags, models, utils


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=5, batch_size=64, lr=1e-3)  # [06]
    flags.accept_local_rank_argument(parser)  # [04]
    parser.add_argument("--no-dropout", action="store_true",  # [06]
                        help="train without dropout, so that the result does not depend on the number of processes "
                             "(see the README's Parity section)")
    # [06] `accelerate launch` passes its config's mixed precision in the environment: that is the
    # default; an explicit --amp overrides it.
    launcher_amp = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    parser.set_defaults(amp="none" if launcher_amp == "no" else launcher_amp)
    return parser.parse_args()


def main():
    args = parse_args()
    utils.seed_everything(args.seed)
    if args.amp == "fp16" and not torch.cuda.is_available():  # [06]
        raise utils.UsageError("--amp fp16 needs a GPU; on the CPU use --amp bf16 or --amp none "  # [06]
                               "(accelerate launch: --mixed_precision no)")
    # [06] one object for 04's set-up: the launcher's environment, the process group, the device.
    accelerator = Accelerator(
        # [06] without GPUs, Accelerate joins the processes into one group only when told to use the CPU;
        # otherwise each process that torchrun starts would train alone, as a world of one.
        cpu=not torch.cuda.is_available(),
        mixed_precision="no" if args.amp == "none" else args.amp,  # [06] autocast, and loss scaling for fp16
        # [06] StepLR decays once per epoch; by default Accelerate steps a scheduler once per process
        # at every call, which is right only for a scheduler stepped with each optimizer step.
        step_scheduler_with_optimizer=False,
        # [06] the loaders yield global batches and `prepare` splits each across the processes, as
        # --batch-size means. Dealing out whole per-process batches instead would, when their number is
        # not a multiple of the processes, pad the last step with batches from the epoch's start.
        dataloader_config=DataLoaderConfiguration(split_batches=True),
        # [06] 04's short timeout: a process that dies or waits for a peer that never comes fails the job
        # in minutes instead of gloo's default 30.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(minutes=5))],
    )
    world_size = accelerator.num_processes  # [06]
    launched = int(os.environ.get("WORLD_SIZE", 1))  # [06] the number of processes the launcher started
    if world_size != launched:  # [06] they must be one group
        raise utils.UsageError(f"the launcher started {launched} processes but Accelerate joined {world_size}: "
                               "each would train alone")
    if args.batch_size % world_size:  # [04] --batch-size is global: each process takes an equal share
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by the world size {world_size}")

    if accelerator.is_local_main_process and not args.synthetic:  # [06] one download per machine
        data.download_mnist(args.data_dir)  # [06]
    accelerator.wait_for_everyone()  # [06] the other processes wait here until the files are complete
    train_set, test_set = data.load_mnist(args.data_dir, args.synthetic, seed=args.seed)  # [06]
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    # [06] the single-process sampler: `prepare` splits each of its batches across the processes.
    sampler = data.EpochShuffleSampler(train_set, seed=args.seed)
    # The loader gets its own generator: otherwise every epoch's iterator draws a seed from the
    # global RNG, and a resumed run's random numbers would no longer match an uninterrupted run's.
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                              num_workers=args.num_workers, generator=torch.Generator().manual_seed(args.seed))
    # [06] a plain loader: `prepare` shards it, and gather_for_metrics drops what it repeats to even it out.
    test_loader = DataLoader(test_set, batch_size=args.batch_size, num_workers=args.num_workers)

    model = models.MnistCNN(dropout=not args.no_dropout)  # [06]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # [06]
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)  # [06] lr x 0.7 each epoch
    # [06] puts the model on the device and wraps it (DDP with several processes, autocast with --amp),
    # wraps the optimizer and scheduler (fp16 loss scaling), and shards the loaders, whose batches
    # then arrive on the device.
    model, optimizer, train_loader, test_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, test_loader, scheduler)
    # [06] the same seed built the same weights everywhere (and DDP broadcast rank 0's); from here on
    # each process needs its own random stream, or all would draw the same dropout masks.
    torch.manual_seed(args.seed + accelerator.process_index)
    total_steps = args.epochs * len(train_loader)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps

    step, start_epoch = 0, 0
    if args.resume:
        step, start_epoch = load_checkpoint(args, accelerator)  # [06]

    meter = utils.Throughput()
    start_time = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        # [06] on the prepared loader, which passes it on to the sampler; it would otherwise reset the
        # sampler to its own count of passes, which starts at 0 again in a resumed run.
        train_loader.set_epoch(epoch)
        meter.start()
        train_loss, new_step = train_one_epoch(args, accelerator, model, train_loader, optimizer, scheduler,  # [06]
                                               epoch, step, last_step)
        meter.stop((new_step - step) * args.batch_size)
        step = new_step
        test_loss, test_accuracy, test_samples = evaluate(accelerator, model, test_loader)  # [06]
        accelerator.print(f"epoch {epoch + 1}/{args.epochs}  step {step}  train_loss {train_loss:.4f}  "  # [06]
                          f"test_loss {test_loss:.4f}  test_accuracy {test_accuracy:.4f}  "
                          f"samples/s {meter.samples_per_second:.1f}  elapsed {time.perf_counter() - start_time:.1f}s")
        if step >= last_step:
            break

    metrics = {
        "script": os.path.basename(__file__),
        "data": "synthetic" if args.synthetic else "mnist",  # [06]
        "device": accelerator.device.type,  # [06]
        "amp": args.amp,
        "world_size": world_size,  # [04]
        "global_batch_size": args.batch_size,
        "steps": step,
        "epochs_completed": step // len(train_loader),
        "train_loss": train_loss,
        "test_loss": test_loss,
        "test_accuracy": test_accuracy,
        "test_samples": test_samples,
        "samples_per_second": meter.samples_per_second,
        "wall_seconds": time.perf_counter() - start_time,
    }
    if accelerator.is_main_process:  # [06] one writer; no collective may run in here
        # [06] unwrap_model takes the DDP wrapper off: a plain fp32 state_dict without "module." prefixes
        utils.save_atomic(accelerator.unwrap_model(model).state_dict(), os.path.join(args.output_dir, "model.pt"))
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))
    # [04] leave together: a rank that tears down its connections while rank 0 is still writing
    # can abort (gloo) instead of exiting cleanly.
    accelerator.wait_for_everyone()  # [06]
    accelerator.end_training()  # [06] destroys the process group


def train_one_epoch(args, accelerator, model, loader, optimizer, scheduler, epoch, step, last_step):  # [06]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=accelerator.device)  # [06]
    # [06] resuming mid-epoch: a loader that skips the batches already trained without loading them
    batches = accelerator.skip_first_batches(loader, done) if done else loader
    progress = tqdm(batches, total=end - done, desc=f"epoch {epoch + 1}", leave=False,  # [06]
                    disable=not accelerator.is_main_process)  # [06]
    for images, labels in progress:  # [06] already on the device: no .to(device)
        loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        accelerator.backward(loss)  # [06] instead of loss.backward(): scales the loss for fp16
        optimizer.step()  # [06] the wrapped optimizer unscales, and skips the step if fp16 gradients overflowed
        step += 1
        if step == (epoch + 1) * len(loader):  # [06] the end of the epoch: StepLR decays once per epoch
            scheduler.step()
        loss_sum += loss.detach()
        if step % 10 == 0:
            # [06] the mean over processes; every process must run the reduce, not only the one that shows it
            progress.set_postfix(loss=f"{accelerator.reduce(loss.detach(), 'mean').item():.3f}")
        if args.save_every and (step % args.save_every == 0 or step == last_step):
            save_checkpoint(args, accelerator, epoch, step)  # [06] on every process, see save_checkpoint
        # [06] stop here rather than cut the loader short with islice as 04 does: Accelerate's loaders
        # close their bookkeeping (the end of the data, the count of passes) only when run to the end.
        if step == last_step:
            break
    return accelerator.reduce(loss_sum, "mean").item() / max(end - done, 1), step  # [06]


@torch.no_grad()
def evaluate(accelerator, model, loader):  # [06]
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=accelerator.device)  # [06] loss sum, correct, samples
    for images, labels in loader:
        logits = model(images)  # [06] autocast with --amp: prepare() wrapped the forward pass
        losses = F.cross_entropy(logits.float(), labels, reduction="none")  # [06]
        correct = (logits.argmax(dim=1) == labels).long()  # [06]
        # [06] every process's results; at the end, without the samples that `prepare` repeated to give
        # every process a full last batch: each test sample counted exactly once, at any world size.
        losses, correct = accelerator.gather_for_metrics((losses, correct))
        totals[0] += losses.sum()  # [06]
        totals[1] += correct.sum()  # [06]
        totals[2] += len(losses)  # [06]
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, accelerator, epoch, step):  # [06]
    """Everything a resumed run needs to continue as if it had never stopped."""
    directory = os.path.join(args.output_dir, "checkpoints", f"step_{step}")  # [06]
    # [06] every process calls it, not only the main one: the main process writes the weights, the
    # optimizer (with the fp16 loss scale) and the scheduler, and each process its own random state,
    # which its dropout draws depend on.
    accelerator.save_state(directory)
    accelerator.wait_for_everyone()  # [06] all files complete before the pointer below moves
    if accelerator.is_main_process:  # [06]
        # [06] save_state writes a directory, not atomically: this small file, written atomically
        # after it, names the newest complete one (and where the loop stood); then the older ones go.
        utils.save_atomic({
            "directory": os.path.basename(directory),  # [06]
            "epoch": epoch,
            "step": step,
            "batch_size": args.batch_size,
            "epochs": args.epochs,
            "seed": args.seed,
            "world_size": accelerator.num_processes,  # [06] one random state per process
        }, os.path.join(args.output_dir, "checkpoint.pt"))
        for name in os.listdir(os.path.dirname(directory)):  # [06]
            if name != os.path.basename(directory):
                shutil.rmtree(os.path.join(os.path.dirname(directory), name))


def load_checkpoint(args, accelerator):  # [06]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    checkpoint = utils.load_checkpoint(os.path.join(args.output_dir, "checkpoint.pt"), map_location="cpu")  # [06]
    utils.check_resumable(checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed,
                          world_size=accelerator.num_processes)  # [06]
    # [06] on every process: the weights, optimizer and scheduler, and this process's random state
    accelerator.load_state(os.path.join(args.output_dir, "checkpoints", checkpoint["directory"]))
    accelerator.print(f"resumed from step {checkpoint['step']}")  # [06]
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main)
