"""DistributedDataParallel from scratch: the wrapper that step 04 imports from PyTorch, written in Python.

Not a step of the tour: a standalone script beside 04, which trains 04's model with 04's data, sampler,
optimizer and schedule, wrapped either in `DataParallelFromScratch` (below) or in PyTorch's
`DistributedDataParallel`, and with gradient accumulation through `no_sync()`. The walk-through is
docs/ddp-from-scratch.md.

Launch (CPU: gloo; GPUs: NCCL, one process per GPU):
    torchrun --standalone --nproc_per_node=2 ddp_from_scratch.py --synthetic --epochs 1
    torchrun --standalone --nproc_per_node=2 ddp_from_scratch.py --synthetic --epochs 1 --ddp torch
    torchrun --standalone --nproc_per_node=2 ddp_from_scratch.py --synthetic --epochs 1 --gradient-accumulation-steps 4
    torchrun --nproc_per_node=N ddp_from_scratch.py    # N GPUs, CIFAR-10
    torchrun --standalone --nproc_per_node=2 benchmarks/float64.py ddp_from_scratch.py --synthetic --norm group

The last runs in float64, as the tests do to compare the weights of the two wrappers (docs/parity.md).

Each rank starts from other random weights on purpose: only the wrapper's broadcast makes the replicas
equal. metrics.json records whether they were equal before wrapping and at the end, and how many
all-reduces each optimizer step launched.
"""

import collections
import contextlib
import datetime
import functools
import itertools
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from common import data, distributed, flags, models, utils


class DataParallelFromScratch(nn.Module):
    """Data parallelism as DistributedDataParallel does it, in Python (docs/ddp-from-scratch.md).

    At construction every rank takes rank 0's parameters and buffers. In backward, each parameter's
    gradient lands in a bucket (about `bucket_cap_mb` MB of gradients, filled in the order backward
    produces them); a complete bucket is all-reduced at once, asynchronously, while backward goes on. When
    backward ends, the wrapper waits for every bucket and puts the mean gradient back into `.grad`, so
    the training loop is the one written for torch's DDP. Inside `no_sync()`, gradients only accumulate.
    """

    def __init__(self, module, bucket_cap_mb=25.0, forward_sync_buffers=True):
        super().__init__()
        self.module = module
        self.forward_sync_buffers = forward_sync_buffers
        self.world_size = dist.get_world_size()
        self.require_sync = True  # False inside no_sync()
        self.all_reduces = 0  # launched so far
        self.buffers_may_differ = False  # True after a training forward (BatchNorm's running statistics)
        # The replicas must start equal: from then on, equal averaged gradients keep them equal.
        self._broadcast_from_rank_0([*module.parameters(), *module.buffers()])

        # Backward produces gradients roughly in the reverse order of the parameters (the last layer's
        # first), so the buckets are filled in that order: the first bucket fills up, and its
        # all-reduce starts, while backward is still working on the early layers.
        parameters = [parameter for parameter in module.parameters() if parameter.requires_grad]
        self.buckets, bucket, size = [], [], 0
        for parameter in reversed(parameters):
            bucket.append(parameter)
            size += parameter.numel() * parameter.element_size()
            if size >= bucket_cap_mb * 2**20:
                self.buckets.append(bucket)
                bucket, size = [], 0
        self.buckets += [bucket] if bucket else []
        for index, bucket in enumerate(self.buckets):
            for parameter in bucket:
                # Called right after backward has added this parameter's gradient into .grad.
                parameter.register_post_accumulate_grad_hook(functools.partial(self._gradient_ready, index))
        self._start_backward()

    def _start_backward(self):
        self.ready = [0] * len(self.buckets)  # gradients ready in each bucket, in this backward
        self.next_bucket = 0  # the first bucket not launched yet
        self.in_flight = []  # (bucket, flat gradients, handle of the asynchronous all-reduce)
        self.callback_queued = False

    @torch.no_grad()
    def _broadcast_from_rank_0(self, tensors):
        # One message per tensor, for clarity; torch's DDP packs them into a few large ones.
        for tensor in tensors:
            dist.broadcast(tensor, src=0)

    def forward(self, *inputs, **kwargs):
        if self.forward_sync_buffers and self.buffers_may_differ:
            # Buffers get no gradient, so nothing averages them: each rank's BatchNorm has updated its running
            # statistics from its own share of the batch. As torch's DDP does, every rank takes rank 0's
            # before the next forward: the next training step's, or the first evaluation batch's.
            self._broadcast_from_rank_0(self.module.buffers())
        self.buffers_may_differ = self.module.training
        return self.module(*inputs, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Backward passes (with their forward) inside only add to each rank's `.grad`; the first backward
        after it all-reduces the sum."""
        previous, self.require_sync = self.require_sync, False
        try:
            yield
        finally:
            self.require_sync = previous

    def _gradient_ready(self, index, parameter):
        if not self.require_sync:
            return  # no_sync(): the gradient stays in .grad, and the next backward adds to it
        if not self.callback_queued:
            # Run _finish when this backward is over (as torch's DDP does): loss.backward() returns
            # with the averaged gradients, and the loop needs no extra call before optimizer.step().
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.callback_queued = True
        self.ready[index] += 1
        # Launch in bucket order only, even if a later bucket is complete first: collectives are matched
        # by the order in which the ranks issue them, so a rank that launched bucket 3 before bucket 2
        # would have its bucket 3 summed with another rank's bucket 2.
        buckets = self.buckets
        while self.next_bucket < len(buckets) and self.ready[self.next_bucket] == len(buckets[self.next_bucket]):
            self._launch(buckets[self.next_bucket])
            self.next_bucket += 1

    def _launch(self, bucket):
        flat = torch.cat([parameter.grad.reshape(-1) for parameter in bucket])  # one message per bucket
        handle = dist.all_reduce(flat, async_op=True)  # returns at once: the sum arrives while backward goes on
        self.in_flight.append((bucket, flat, handle))
        self.all_reduces += 1

    def _finish(self):
        if self.next_bucket < len(self.buckets):
            # Else that bucket and the later ones would never be averaged: the replicas would drift apart silently.
            raise RuntimeError("a parameter got no gradient in this backward: torch's DDP handles that with "
                               "find_unused_parameters=True, this wrapper does not")
        for bucket, flat, handle in self.in_flight:
            handle.wait()
            flat /= self.world_size  # the sum of the ranks' gradients -> their mean: the whole batch's gradient
            for parameter, mean in zip(bucket, flat.split([parameter.numel() for parameter in bucket]), strict=True):
                parameter.grad.copy_(mean.view_as(parameter.grad))
        self._start_backward()


def counting_allreduce_hook(model, bucket):
    """A comm hook for torch's DDP: count the bucket's all-reduce, then do what DDP does by default."""
    model.all_reduces += 1
    return default_hooks.allreduce_hook(None, bucket)  # divide by the world size, all-reduce, as a Future


def replicas_equal(model):
    """Whether every rank holds the same parameters. A collective: every rank calls it, and every rank gets
    the same answer (the elementwise minimum and maximum over the ranks agree only if the ranks do)."""
    flat = torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])
    low, high = flat.clone(), flat.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    return torch.equal(low, high)


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=0.2)
    flags.add_norm_argument(parser)
    parser.add_argument("--ddp", choices=["scratch", "torch"], default="scratch",
                        help="the wrapper: DataParallelFromScratch, or torch.nn.parallel.DistributedDataParallel")
    parser.add_argument("--bucket-cap-mb", type=float, default=25.0, help="gradient bucket size (DDP's default: 25)")
    parser.add_argument("--gradient-accumulation-steps", "--gradient_accumulation_steps", type=flags.positive_int,
                        default=1, help="split each rank's share of a batch into N micro-batches: one optimizer "
                                        "step and one all-reduce per bucket for N backward passes")
    args = parser.parse_args()
    if args.save_every or args.resume:
        raise utils.UsageError("ddp_from_scratch.py writes no checkpoints; --save-every and --resume are 04's")
    return args


def main():
    args = parse_args()
    utils.seed_everything(args.seed)
    distributed.default_to_a_world_of_one()
    rank, local_rank, world_size = (int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        distributed.require_one_gpu_per_process()
        torch.cuda.set_device(local_rank)
        utils.use_deterministic_kernels()
    if not args.synthetic:  # before the process group, as in 04: a download can outlast its timeout
        data.download_cifar10(args.data_dir)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=datetime.timedelta(minutes=5))
    accumulation = args.gradient_accumulation_steps
    if args.batch_size % (world_size * accumulation):
        raise utils.UsageError(f"--batch-size {args.batch_size} is not divisible by the world size {world_size} "
                               f"times --gradient-accumulation-steps {accumulation}")
    batch_size = args.batch_size // world_size

    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set ({len(train_set)})")
    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=args.seed, drop_last=True)
    train_loader = data.BatchLoader(train_set, batch_size, sampler=sampler, drop_last=True, device=device,
                                    num_workers=args.num_workers)
    test_batches = data.equal_batches(len(test_set), world_size, rank, batch_size)  # 04's disjoint slices
    test_loader = data.BatchLoader(test_set, batch_sampler=test_batches, device=device, num_workers=args.num_workers)

    # Another seed on every rank, on purpose: the replicas start different, and only the wrapper's
    # broadcast makes them equal. Rank 0's seed is 04's, so all ranks continue from 04's initial weights.
    torch.manual_seed(args.seed + rank)
    model = models.ResNet9(norm=args.norm).to(device)
    equal_before_wrapping = replicas_equal(model)
    if args.ddp == "scratch":
        model = DataParallelFromScratch(model, bucket_cap_mb=args.bucket_cap_mb)
    else:
        model = DistributedDataParallel(model, device_ids=[local_rank] if device.type == "cuda" else None,
                                        bucket_cap_mb=args.bucket_cap_mb)
        model.all_reduces = 0
        model.register_comm_hook(state=model, hook=counting_allreduce_hook)  # `state` is the hook's first argument
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps

    step, record = 0, utils.RunRecord(__file__, utils.Context(args, device, world_size=world_size), len(train_loader))
    all_reduces = collections.Counter()  # {n: how many optimizer steps launched n all-reduces}
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        record.start_training(step)
        train_loss, steps = train_one_epoch(model, train_loader, optimizer, scheduler, accumulation, device,
                                            last_step - step, all_reduces)
        step += steps
        record.stop_training(step)
        test_loss, test_accuracy, test_samples = evaluate(model, test_loader, device)
        record.end_epoch(epoch, step, train_loss, test_loss, test_accuracy, test_samples,
                         more=f"steps by all-reduces {dict(all_reduces)}")
        if step >= last_step:
            break

    metrics = {
        **record.metrics(),
        "ddp": args.ddp, "gradient_accumulation_steps": accumulation, "bucket_cap_mb": args.bucket_cap_mb,
        "buckets": len(model.buckets) if args.ddp == "scratch" else None,  # torch's DDP keeps its own in C++
        "all_reduces": model.all_reduces, "steps_by_all_reduces": dict(sorted(all_reduces.items())),
        "replicas_equal_before_wrapping": equal_before_wrapping,
        "replicas_equal_at_end": replicas_equal(model),  # a collective: outside the rank-0 branch below
    }
    if rank == 0:
        utils.save_atomic(model.module.state_dict(), os.path.join(args.output_dir, "model.pt"))
        utils.write_json(metrics, os.path.join(args.output_dir, "metrics.json"))
    dist.barrier()
    dist.destroy_process_group()


def train_one_epoch(model, loader, optimizer, scheduler, accumulation, device, steps_left, all_reduces):
    """Train until the end of the epoch or for `steps_left` steps; returns the mean loss and the steps taken.
    Counts each step in `all_reduces[number of all-reduces it launched]`."""
    model.train()
    loss_sum, steps = torch.zeros((), device=device), 0
    for images, labels in itertools.islice(loader, steps_left):
        optimizer.zero_grad(set_to_none=True)
        launched_before = model.all_reduces
        micro_batches = zip(images.chunk(accumulation), labels.chunk(accumulation), strict=True)
        for index, (micro_images, micro_labels) in enumerate(micro_batches):
            # The first N-1 backward passes only add to each rank's .grad; the last one all-reduces the sum.
            with model.no_sync() if index < accumulation - 1 else contextlib.nullcontext():
                # Divided by N: the sum of N equal micro-batches' mean losses / N is the mean over the batch.
                loss = F.cross_entropy(model(micro_images), micro_labels) / accumulation
                loss.backward()
            loss_sum += loss.detach()
        all_reduces[model.all_reduces - launched_before] += 1
        optimizer.step()
        scheduler.step()
        steps += 1
    return distributed.all_reduce_mean(loss_sum).item() / max(steps, 1), steps


@torch.no_grad()
def evaluate(model, loader, device):
    """Mean loss and accuracy over the whole test set (each rank holds a disjoint slice); returns them and
    the number of samples."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, correct, samples
    for images, labels in loader:
        logits = model(images)
        totals[0] += F.cross_entropy(logits, labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)  # gloo threads would abort Python's shutdown (see utils.run)
