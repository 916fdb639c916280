"""Four ways to start the processes of one DDP job: the `init_method`s env://, tcp:// and file://, and
`torch.multiprocessing.spawn`.

Not a step of the tour: a standalone script beside 04, which trains 04's model with 04's data, sampler,
optimizer and schedule, to 04's weights for the same arguments. Only the way its processes find each other
differs: `--init` picks the `init_process_group` call. When to use which: docs/init-methods.md.

Launch two processes on this machine (CPU: gloo; GPUs: NCCL, one process per GPU):
    torchrun --standalone --nproc_per_node=2 init_methods.py --init env
    python init_methods.py --init tcp --master-addr 127.0.0.1 --master-port 29500 --world-size 2 --rank 0
    python init_methods.py --init tcp --master-addr 127.0.0.1 --master-port 29500 --world-size 2 --rank 1
    python init_methods.py --init file --init-file /tmp/init_methods.rendezvous --world-size 2 --rank 0
    python init_methods.py --init file --init-file /tmp/init_methods.rendezvous --world-size 2 --rank 1
    python init_methods.py --init spawn --world-size 2

Each tcp and file command starts one process: run the two in two terminals, or on two machines (then
--master-addr is the address of rank 0's machine, and --init-file a path on a file system both see).
Add `--synthetic --epochs 1` for a short run on generated data, without the download.
"""

import datetime
import itertools
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from common import data, distributed, flags, models, utils

# 04's timeout: a process that waits for a peer that never comes fails in minutes, not after gloo's 30.
TIMEOUT = datetime.timedelta(minutes=5)
# The flags that each --init needs; it refuses the others, which it would ignore.
NEEDS = {"env": set(), "tcp": {"rank", "world_size"}, "file": {"rank", "world_size", "init_file"},
         "spawn": {"world_size"}}


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    parser.add_argument("--init", choices=list(NEEDS), default="env",
                        help="env: under torchrun; tcp, file: processes started by hand; spawn: one command")
    parser.add_argument("--rank", type=int, help="tcp, file: this process's number, 0 to world size - 1")
    parser.add_argument("--world-size", type=flags.positive_int,
                        help="tcp, file: the number of processes in the job; spawn: how many to start")
    parser.add_argument("--master-addr", default="127.0.0.1", help="tcp: the address of rank 0's machine")
    parser.add_argument("--master-port", type=int, default=29500, help="tcp: the port that rank 0 listens on")
    parser.add_argument("--init-file", help="file: the same path for every process, on a file system they all see")
    args = parser.parse_args()
    for name in ("rank", "world_size", "init_file"):
        if (getattr(args, name) is None) == (name in NEEDS[args.init]):
            verb = "needs" if name in NEEDS[args.init] else "takes no"
            raise utils.UsageError(f"--init {args.init} {verb} --{name.replace('_', '-')}")
    if args.rank is not None and not 0 <= args.rank < args.world_size:
        raise utils.UsageError(f"--rank must be 0 to {args.world_size - 1} with --world-size {args.world_size}, "
                               f"got {args.rank}")
    if args.save_every or args.resume:
        raise utils.UsageError("init_methods.py writes no checkpoints; --save-every and --resume are 04's")
    return args


def main():
    args = parse_args()
    if args.init == "env":
        distributed.default_to_a_world_of_one()  # started by plain `python`
        args.rank, args.world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.batch_size % args.world_size:
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by the world size {args.world_size}")
    if args.init != "spawn":
        train(args)
        return
    # All on this machine, on a port that no program uses now, for rank 0 to listen on. Another could take
    # it before rank 0 does: rank 0 then reports the port in use, and a second try gets another.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        args.master_addr, args.master_port = sock.getsockname()
    # Starts `world_size` fresh Python processes and runs spawned(index, args) in each. When one fails, the
    # others are terminated: on bad input the first process prints it and exits first (utils.run).
    processes = mp.spawn(spawned, args=(args,), nprocs=args.world_size, join=False)
    try:
        while not processes.join():
            pass
    except mp.ProcessExitedException as error:  # the process printed why
        sys.exit(error.exit_code)


def spawned(index, args):
    """What each process that mp.spawn starts runs, `index` being 0 to nprocs - 1. At module level of a file:
    the new processes import the file to find it by name, so a nested function, a lambda or a function
    defined in a notebook fails."""
    os.environ.update(LOCAL_RANK=str(index), LOCAL_WORLD_SIZE=str(args.world_size))  # as torchrun sets them
    args.rank = index
    utils.run(lambda: train(args), skip_python_shutdown=True)  # bad input: one error line, from index 0


def train(args):
    """04's training, in one process of the job."""
    utils.seed_everything(args.seed)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        distributed.require_one_gpu_per_process()
        # torchrun and spawned() set LOCAL_RANK; processes started by hand are numbered machine by machine.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", args.rank % torch.cuda.device_count())))
        torch.cuda.set_device(device)  # before any CUDA work, or every process would use GPU 0
        utils.use_deterministic_kernels()
    elif args.init != "env" and "OMP_NUM_THREADS" not in os.environ:
        # torchrun gives each process one thread. Without it, every process of a CPU job uses every core,
        # and they fight over them: 2 processes on 2 cores trained 5 to 10 times slower here.
        torch.set_num_threads(1)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not args.synthetic:  # before the process group, as in 04: a download can outlast its timeout
        data.download_cifar10(args.data_dir)

    # The lesson: the same process group, joined four ways. Every process of the job makes the same call.
    if args.init == "env":  # torchrun has set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: env:// reads them
        url = "env://"
        dist.init_process_group(backend, init_method=url, timeout=TIMEOUT)
    elif args.init in ("tcp", "spawn"):  # rank 0 listens on the address, the others connect to it
        url = f"tcp://{args.master_addr}:{args.master_port}"
        dist.init_process_group(backend, init_method=url, rank=args.rank, world_size=args.world_size, timeout=TIMEOUT)
    else:  # the processes meet in a file on a shared file system (no rendezvous port; gloo still connects them)
        init_file = os.path.abspath(args.init_file)  # file:// and an absolute path: file:///shared/...
        # A file left by an earlier job holds the addresses of its dead processes: a new job may read them
        # and hang until its timeout. So each process claims its rank in the file first, and a rank claimed
        # twice is refused at once (a store of world size -1, the default, never deletes its file).
        if dist.FileStore(init_file).add(f"init_methods/rank_{args.rank}", 1) > 1:
            raise utils.UsageError(f"--init-file {init_file} is left from an earlier job (or --rank {args.rank} "
                                   "was given twice): delete it, then start every process again")
        url = f"file://{init_file}"
        dist.init_process_group(backend, init_method=url, rank=args.rank, world_size=args.world_size, timeout=TIMEOUT)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # One write per line: the processes share the terminal, and two lines written piecewise can interleave.
    print(f"rank {rank} of {world_size} joined through {url}\n", end="", flush=True)

    # From here on, 04 (docs/ddp.md).
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)
    train_loader = data.BatchLoader(train_set, args.batch_size // world_size, sampler=sampler, drop_last=True,
                                    device=device, num_workers=args.num_workers)
    test_batches = data.equal_batches(len(test_set), world_size, rank, args.batch_size // world_size)  # as 04's
    test_loader = data.BatchLoader(test_set, batch_sampler=test_batches, device=device, num_workers=args.num_workers)
    model = DistributedDataParallel(models.ResNet9().to(device), device_ids=[device] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps

    step, record = 0, utils.RunRecord(__file__, utils.Context(args, device, world_size=world_size), len(train_loader))
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)  # or DistributedSampler repeats epoch 0's order
        train_set.set_epoch(epoch)
        record.start_training(step)
        model.train()
        loss_sum, steps = torch.zeros((), device=device), min(len(train_loader), last_step - step)
        for images, labels in itertools.islice(train_loader, steps):
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            loss_sum += loss.detach()
        step += steps
        record.stop_training(step)
        train_loss = distributed.all_reduce_mean(loss_sum).item() / steps
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device)
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples)
        if step >= last_step:
            break

    metrics = {**record.metrics(), "init": args.init, "init_method": url}
    if rank == 0:  # one writer, and no collective inside
        utils.save_atomic(model.module.state_dict(), os.path.join(args.output_dir, "model.pt"))  # no "module." keys
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))
    dist.barrier()
    if args.init == "file" and rank == 0:
        # Every process is past the rendezvous. The store would delete the file when the last process closes
        # it, but DDP keeps it open to the end, where nothing closes it: the next job would find it.
        os.remove(init_file)
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model, loader, device):
    """04's evaluation: each rank a disjoint slice of the test set, the totals summed over the ranks."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:  # already on `device`
        logits = model(images)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


if __name__ == "__main__":  # not when the processes that mp.spawn starts import this file
    utils.run(main, skip_python_shutdown=True)  # gloo threads would abort Python's shutdown (see utils.run)
