"""Step 05: the same processes, with the DeepSpeed engine: ZeRO, mixed precision, ds_config.json.

New (relative to step 04; lines marked `# [05]`): `deepspeed.initialize` wraps the model in an
engine that takes over what 04 wrote by hand: it builds the optimizer from `ds_config.json`, averages
the gradients across processes, runs fp16 (with loss scaling) or bf16, partitions the optimizer
state (ZeRO-1), the gradients (ZeRO-2) and the weights themselves (ZeRO-3) across the processes,
and writes checkpoints in which every rank saves its own shard. The loop stays ours:
`model(images)`, `model.backward(loss)`, `model.step()`. The command line overrides the config
file where both speak (batch size, learning rate, precision, ZeRO stage).

Launch:
    deepspeed --num_gpus=N 05_cifar10_deepspeed.py --amp bf16            # N GPUs on this machine
    torchrun --nproc_per_node=N 05_cifar10_deepspeed.py --zero-stage 3     # the same, started by torchrun
    deepspeed --hostfile=hostfile 05_cifar10_deepspeed.py                # every GPU of the hosts listed
    python 05_cifar10_deepspeed.py --synthetic --epochs 1                  # a world of one
    OMP_NUM_THREADS=1 deepspeed --num_gpus=2 05_cifar10_deepspeed.py --synthetic --epochs 1  # no GPU: gloo
A hostfile has one line per machine, `HOST slots=GPUS`; the launcher reaches them by ssh (pdsh), or,
without ssh, run it on every machine with --no_ssh --node_rank=R --master_addr=FIRST_HOST. Without
a GPU, --num_gpus is the number of CPU processes; unlike torchrun, the launcher does not limit their
threads, so give each its share of the cores (OMP_NUM_THREADS) or they slow each other down. The
first run on a CPU compiles a small DeepSpeed op (a minute or two, then cached), with the ninja
that comes with DeepSpeed: activate the environment so that it is on PATH.

Next: 06_mnist_accelerate.py writes the loop once for any launcher and backend, with Accelerate.
"""

import datetime  # [04]
import itertools
import json  # [05]
import math  # [05]
import os
import shutil  # [05]
import time

import deepspeed  # [05]
import torch
import torch.distributed as dist  # [04]
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator  # [05]
from deepspeed.runtime.zero.utils import ZeRORuntimeException  # [05]
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # [05]
from torch.utils.data import DataLoader, Subset  # [04]
from torch.utils.data.distributed import DistributedSampler  # [04]
from tqdm import tqdm

from common import data, flags, models, utils
from common.distributed import all_reduce_mean, print0  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_norm_argument(parser)
    flags.accept_local_rank_argument(parser)  # [04]
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,  # [05]
                        help="ZeRO stage (default: the config file's)")
    parser.add_argument("--deepspeed-config", help="DeepSpeed config file (default: ds_config.json beside this script)",
                        default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json"))  # [05]
    return parser.parse_args()


def main():
    args = parse_args()
    utils.seed_everything(args.seed)
    try:  # [05]
        with open(args.deepspeed_config) as file:
            config = json.load(file)
    except OSError as error:
        raise utils.UsageError(f"--deepspeed-config {args.deepspeed_config}: {error.strerror}") from None
    except ValueError as error:
        raise utils.UsageError(f"--deepspeed-config {args.deepspeed_config} is not valid JSON: {error}") from None
    # [04] torchrun tells each process who it is: its rank among all processes, its rank on this
    # machine (which GPU to drive) and how many processes there are. So does the deepspeed launcher.
    # [05] Plain `python` sets none of it: then this process is a world of one. Port 0: the OS picks
    # a free port, since no other process has to find it.
    if "LOCAL_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    if torch.cuda.is_available():  # [04]
        # [05] processes on this machine: one per GPU (the deepspeed launcher names it LOCAL_SIZE)
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("LOCAL_SIZE", "1")))
        if local_world_size > torch.cuda.device_count():
            raise utils.UsageError(f"{local_world_size} processes on this machine but {torch.cuda.device_count()} "
                                   "GPU(s): start one process per GPU (--nproc_per_node, --num_gpus)")
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        print0("no GPU found: training on the CPU with the gloo backend")
    # [04] a short timeout: a rank that dies or waits for a peer that never comes fails the job in
    # minutes instead of gloo's default 30.
    # [05] DeepSpeed's communication layer over torch.distributed (initialize would start it, but we need it now)
    deepspeed.init_distributed("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    if args.batch_size % world_size:  # [04] --batch-size is global: each process takes an equal share
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by the world size {world_size}")
    batch_size = args.batch_size // world_size  # [04]
    # [05] DeepSpeed says which 16-bit formats its accelerator (this GPU, or the CPU) can train in.
    if args.amp != "none" and not getattr(get_accelerator(), f"is_{args.amp}_supported")():
        print0(f"--amp {args.amp}: not supported by DeepSpeed on this {device.type}; training in fp32")
        args.amp = "none"
    # [05] DeepSpeed's fp16/bf16 turn the weights themselves into 16 bits (the optimizer keeps fp32
    # master copies), not autocast: the inputs must be cast to match.
    amp_dtype = flags.AMP_DTYPES[args.amp] or torch.float32

    if local_rank == 0 and not args.synthetic:  # [04] one download per machine, never two into one directory
        data.download_cifar10(args.data_dir)
    dist.barrier()  # [04] the other ranks wait here until the files are complete
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    if len(test_set) < world_size:  # [04] each rank evaluates its own slice of the test set: none may be empty
        raise utils.UsageError(f"the test set has {len(test_set)} samples, fewer than the {world_size} processes")
    # [04] every rank shuffles with the same seed and keeps every world_size-th sample: the ranks'
    # batches are disjoint, and together they are the global batch that 01-03 would take.
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)
    # The loader gets its own generator: otherwise every epoch's iterator draws a seed from the
    # global RNG, and a resumed run's random numbers would no longer match an uninterrupted run's.
    train_loader = DataLoader(train_set, batch_size=batch_size, sampler=sampler, drop_last=True,  # [04]
                              num_workers=args.num_workers, generator=torch.Generator().manual_seed(args.seed),
                              pin_memory=device.type == "cuda")  # [02] page-locked batches copy asynchronously
    # [04] each rank evaluates a disjoint slice; not DistributedSampler, which pads the slices to equal
    # length with repeated samples, so some test samples would be counted twice.
    test_shard = Subset(test_set, range(rank, len(test_set), world_size))
    # [05] under ZeRO-3 every forward pass gathers the weights from all ranks, so every rank must run
    # as many test batches as the others (a slice one sample shorter could need one batch fewer and
    # leave the others waiting): each slice is split into the number of batches the longest needs.
    num_batches = min(math.ceil(math.ceil(len(test_set) / world_size) / batch_size), len(test_set) // world_size)
    test_batches = [indices.tolist() for indices in torch.arange(len(test_shard)).tensor_split(num_batches)]
    test_loader = DataLoader(test_shard, batch_sampler=test_batches, num_workers=args.num_workers,
                             pin_memory=device.type == "cuda")  # [02]

    # [05] the command line wins where it and ds_config.json both speak. --batch-size stays the global
    # batch: each process takes an equal share, with no gradient accumulation (DeepSpeed checks that
    # train_batch_size = micro batch x accumulation steps x world size).
    config.update(train_batch_size=args.batch_size, train_micro_batch_size_per_gpu=batch_size,
                  gradient_accumulation_steps=1)
    config["optimizer"]["params"]["lr"] = args.lr
    config.setdefault("fp16", {})["enabled"] = args.amp == "fp16"  # dynamic loss scaling: see the config
    config.setdefault("bf16", {})["enabled"] = args.amp == "bf16"
    if args.amp != "none":  # DeepSpeed casts only the parameters; BatchNorm needs its statistics to match
        config.setdefault("data_types", {})["buffer_dtype"] = args.amp
    if args.zero_stage is not None:
        config.setdefault("zero_optimization", {})["stage"] = args.zero_stage

    model = models.ResNet9(norm=args.norm).to(device)
    total_steps = args.epochs * len(train_loader)
    # [05] the engine broadcasts rank 0's weights, builds the optimizer the config names (wrapped for
    # ZeRO and 16 bits), and averages the gradients across ranks in backward. Our one-cycle schedule
    # goes in as a function of that optimizer; the engine steps it and keeps it in its checkpoints.
    model, _, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                                           total_steps=total_steps))
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps

    step, start_epoch = 0, 0
    if args.resume:
        step, start_epoch = load_checkpoint(args, model)  # [05]

    meter = utils.Throughput()
    start_time = time.perf_counter()
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)  # [04] without it, DistributedSampler repeats epoch 0's order forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        meter.start()
        train_loss, new_step = train_one_epoch(args, model, train_loader, device, amp_dtype, epoch, step,  # [05]
                                               last_step)
        meter.stop((new_step - step) * args.batch_size)
        step = new_step
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device, amp_dtype)  # [02]
        print0(f"epoch {epoch + 1}/{args.epochs}  step {step}  train_loss {train_loss:.4f}  "
              f"test_loss {test_loss:.4f}  test_accuracy {test_accuracy:.4f}  "
              f"samples/s {meter.samples_per_second:.1f}  elapsed {time.perf_counter() - start_time:.1f}s")
        if step >= last_step:
            break

    metrics = {
        "script": os.path.basename(__file__),
        "data": "synthetic" if args.synthetic else "cifar10",
        "device": device.type,
        "amp": args.amp,
        "world_size": world_size,  # [04]
        "zero_stage": model.zero_optimization_stage(),  # [05]
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
    if rank == 0:  # [04] one writer; no collective may run in here, or the other ranks would never join it
        # [05] model.pt holds fp32 weights. Under ZeRO they exist only as the ranks' shards of the
        # optimizer state (the module's copies are 16-bit with --amp, and empty under ZeRO-3):
        # DeepSpeed's zero_to_fp32, its offline converter, reassembles them from the final checkpoint.
        if model.zero_optimization_stage() > 0:
            state_dict = get_fp32_state_dict_from_zero_checkpoint(os.path.join(args.output_dir, "checkpoints"))
        else:  # [05] no ZeRO: every rank holds the whole model (in 16 bits with --amp)
            state_dict = model.module.state_dict()  # [04] the weights are in model.module, without "module."
        state_dict = {name: t.float() if t.is_floating_point() else t for name, t in state_dict.items()}  # [05]
        utils.save_atomic(state_dict, os.path.join(args.output_dir, "model.pt"))  # [05]
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))
    # [04] leave together: a rank that tears down its connections while rank 0 is still writing
    # can abort (gloo) instead of exiting cleanly.
    dist.barrier()
    dist.destroy_process_group()


def train_one_epoch(args, model, loader, device, amp_dtype, epoch, step, last_step):  # [05]
    """Train until the end of `epoch` or `last_step`; returns the mean loss and the new step."""
    model.train()
    done = step - epoch * len(loader)  # batches of this epoch already trained (resuming mid-epoch)
    end = min(len(loader), done + last_step - step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(itertools.islice(loader, done, end), total=end - done, desc=f"epoch {epoch + 1}", leave=False,
                    disable=dist.get_rank() != 0)  # [04]
    for images, labels in progress:
        images, labels = images.to(device, amp_dtype, non_blocking=True), labels.to(device, non_blocking=True)  # [05]
        loss = F.cross_entropy(model(images).float(), labels)  # [05] the loss in fp32, whatever the weights
        model.backward(loss)  # [05] scales the loss for fp16, then averages the gradients across ranks
        # [05] the optimizer step (skipped if fp16 gradients overflowed), the LR schedule, zero_grad
        model.step()
        step += 1
        loss_sum += loss.detach()
        if step % 10 == 0:
            # [04] the mean over ranks; every rank must run the all-reduce, not only rank 0 that shows it
            progress.set_postfix(loss=f"{all_reduce_mean(loss).item():.3f}")
        # [05] every rank saves, its own shard. Always at the end: model.pt is rebuilt from that checkpoint.
        if step == last_step or args.save_every and step % args.save_every == 0:
            save_checkpoint(args, model, epoch, step)
    return all_reduce_mean(loss_sum).item() / max(end - done, 1), step  # [04]


@torch.no_grad()
def evaluate(model, loader, device, amp_dtype):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    model.eval()
    # [05] DeepSpeed, unlike DDP, never synchronises buffers: each rank's BatchNorm statistics have
    # followed its own batches. Evaluate with rank 0's everywhere, the ones that model.pt keeps.
    for buffer in model.module.buffers():
        dist.broadcast(buffer, src=0)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        images, labels = images.to(device, amp_dtype, non_blocking=True), labels.to(device, non_blocking=True)  # [05]
        logits = model(images)  # [05]
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [04] sums over ranks: each holds the totals of its own slice
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(args, model, epoch, step):  # [05]
    """Everything a resumed run needs to continue as if it had never stopped."""
    # [05] every rank must call this: each writes its own shard of the optimizer state (under ZeRO-3
    # also of the weights), with barriers inside. Called by rank 0 alone, it would hang; shards lost.
    # The engine saves the weights, optimizer, LR schedule and loss scale; we add the rest.
    directory = os.path.join(args.output_dir, "checkpoints")  # [05]
    model.save_checkpoint(directory, tag=f"step{step}", save_latest=False, client_state={  # [05]
        "epoch": epoch,
        "step": step,
        "rng": utils.get_rng_state(),
        "batch_size": args.batch_size,
        "epochs": args.epochs,
        "seed": args.seed,
    })
    # [05] each checkpoint is a new directory, and `latest` names the one to resume from. DeepSpeed's
    # own `latest` is written by rank 0 before the other ranks have finished their shards, and not
    # atomically: we write it once save_checkpoint has returned (after its final barrier), atomically,
    # so that a crash mid-save leaves `latest` naming the previous, complete checkpoint.
    if dist.get_rank() == 0:
        utils.write_text(f"step{step}", os.path.join(directory, "latest"))
        for name in os.listdir(directory):  # older checkpoints are no longer needed
            if name.startswith("step") and name != f"step{step}":
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def load_checkpoint(args, model):  # [05]
    """Restore `save_checkpoint`'s state; returns the step and the epoch to continue from."""
    directory = os.path.join(args.output_dir, "checkpoints")  # [05]
    if not os.path.isfile(os.path.join(directory, "latest")):  # [05]
        raise utils.UsageError(f"--resume: no checkpoint in {directory}; run once with --save-every first")
    try:  # [05] every rank reads its shard of the `latest` checkpoint
        _, checkpoint = model.load_checkpoint(directory)
    except ZeRORuntimeException as error:  # [05] ZeRO's shards fit only the world size that wrote them
        raise utils.UsageError(f"cannot resume from {directory}: {error}") from None
    utils.check_resumable(checkpoint, batch_size=args.batch_size, epochs=args.epochs, seed=args.seed)
    utils.set_rng_state(checkpoint["rng"])
    print0(f"resumed from step {checkpoint['step']}")
    return checkpoint["step"], checkpoint["epoch"]


if __name__ == "__main__":
    utils.run(main)
