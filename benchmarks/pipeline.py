"""02's training step taken apart: the input pipeline alone, the model alone, and both, in one run.

    python benchmarks/pipeline.py                                  # synthetic data, the GPU if there is one
    python benchmarks/pipeline.py --data-dir ./data --amp bf16     # real CIFAR-10 images

Four loops, each timed over --steps steps after --warmup steps:
- pipeline alone: 02's training loader (data.BatchLoader: uint8 batches to the device, augmented there);
- one by one: the same batches from a classic DataLoader that prepares each sample in `__getitem__`
  (no workers), copied to the device, for comparison;
- model alone: 02's training step (forward under autocast, backward, SGD) on one batch already on the device;
- full step: both, as 02 trains.
It prints images/s for each and their ratios, and the model's FLOP rate: FLOPs of one training step counted
with torch.utils.flop_counter, per second of the full step, against the device's peak (a GPU: its dense
tensor-core peak for --amp's dtype where the table below knows the GPU; otherwise, and on a CPU, the rate of
large matrix products measured in the same run).
"""

import argparse
import itertools
import sys
import time

import launch
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(launch.ROOT))  # common/ is beside benchmarks/
from common import data, flags, models, utils  # noqa: E402

# Dense (no sparsity) tensor-core peaks in FLOP/s from the vendors' data sheets, SXM parts.
PEAKS = {
    "H100": {torch.bfloat16: 989e12, torch.float16: 989e12},
    "H200": {torch.bfloat16: 989e12, torch.float16: 989e12},
    "A100": {torch.bfloat16: 312e12, torch.float16: 312e12},
}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", help="real CIFAR-10, as a step's --data-dir (default: the synthetic data)")
    parser.add_argument("--batch-size", type=flags.positive_int, default=256, help="02's default")
    parser.add_argument("--width", type=flags.positive_int, default=32, help="ResNet-9's width, as 02's --width")
    parser.add_argument("--amp", choices=list(flags.AMP_DTYPES), default="none", help="as 02's --amp")
    parser.add_argument("--steps", type=flags.positive_int, default=50, help="timed steps per loop")
    parser.add_argument("--warmup", type=flags.positive_int, default=5, help="untimed steps before each loop")
    return parser.parse_args(argv)


def synchronize(device):
    if device.type == "cuda":  # GPU work is asynchronous: the clock must wait for it
        torch.cuda.synchronize()


def images_per_second(run_one_step, steps, warmup, batch_size, device):
    for _ in range(warmup):
        run_one_step()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        run_one_step()
    synchronize(device)
    return steps * batch_size / (time.perf_counter() - start)


def endless_batches(loader, train_set, sampler):
    """The loader's batches, epoch after epoch, as 02 draws them."""
    for epoch in itertools.count():
        sampler.set_epoch(epoch)
        train_set.set_epoch(epoch)
        yield from loader


def matmul_flops_per_second(device, dtype, repeat=10):
    """The rate of large square matrix products: what this device computes when nothing holds it back."""
    size = 8192 if device.type == "cuda" else 1024  # a second or less of work on either
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    (a @ b).sum().item()
    synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b
    synchronize(device)
    return 2 * size**3 * repeat / (time.perf_counter() - start)


def main():
    args = parse_args()
    utils.seed_everything(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        utils.use_deterministic_kernels()  # as 02 trains
    amp_dtype = flags.AMP_DTYPES[args.amp]  # fp16 runs on a CPU too, as in 02 (slowly: docs/mixed-precision.md)

    train_set, _ = data.load_cifar10(args.data_dir, synthetic=args.data_dir is None)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0)
    loader = data.BatchLoader(train_set, args.batch_size, sampler=sampler, drop_last=True, device=device)
    model = models.ResNet9(width=args.width).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype is torch.float16)

    def train_step(images, labels):
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = F.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    batches = endless_batches(loader, train_set, sampler)
    one_by_one = endless_batches(DataLoader(train_set, args.batch_size, sampler=sampler, drop_last=True,
                                            pin_memory=device.type == "cuda"), train_set, sampler)
    fixed_batch = next(batches)
    with FlopCounterMode(display=False) as counter:
        train_step(*fixed_batch)
    flops_per_step = counter.get_total_flops()

    rates = {
        "pipeline alone": images_per_second(lambda: next(batches), args.steps, args.warmup, args.batch_size, device),
        "one by one": images_per_second(lambda: [tensor.to(device, non_blocking=True) for tensor in next(one_by_one)],
                                        args.steps, args.warmup, args.batch_size, device),
        "model alone": images_per_second(lambda: train_step(*fixed_batch), args.steps, args.warmup,
                                         args.batch_size, device),
        "full step": images_per_second(lambda: train_step(*next(batches)), args.steps, args.warmup,
                                       args.batch_size, device),
    }
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    peak_dtype = amp_dtype or torch.get_default_dtype()
    peak = next((peaks.get(peak_dtype) for gpu, peaks in PEAKS.items() if gpu in name), None)
    peak_source = "data sheet"
    if peak is None:
        peak, peak_source = matmul_flops_per_second(device, peak_dtype), "large matmuls measured here"

    print(f"{name}, torch {torch.__version__}, data {args.data_dir or 'synthetic'}, batch {args.batch_size}, "
          f"--amp {args.amp}, width {args.width}, {args.steps} steps per loop")
    for loop, rate in rates.items():
        print(f"{loop:<15} {rate:>12,.0f} images/s")
    print(f"pipeline alone / one by one: {rates['pipeline alone'] / rates['one by one']:.1f}; "
          f"pipeline alone / model alone: {rates['pipeline alone'] / rates['model alone']:.1f}; "
          f"full step / model alone: {rates['full step'] / rates['model alone']:.3f}")
    achieved = flops_per_step / args.batch_size * rates["full step"]
    print(f"model: {flops_per_step / args.batch_size / 1e6:,.0f} MFLOP per training image; full step at "
          f"{achieved / 1e12:.3g} TFLOP/s = {achieved / peak:.1%} of {peak / 1e12:.3g} TFLOP/s "
          f"({str(peak_dtype).removeprefix('torch.')}, {peak_source})")


if __name__ == "__main__":
    main()
