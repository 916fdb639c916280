"""One data pipeline for every step: images as uint8 tensors in memory, cheap augmentation.

CIFAR-10 for steps 01-05 and 07-11, MNIST for step 06; both through torchvision, both with a generated
stand-in of the same shape (`--synthetic`).

Determinism is the point of this module. The order of the training samples depends only on the
seed and the epoch (`DistributedSampler`: 01-03 use it with one replica, the order that the other steps
split between ranks), and so do the augmentation draws (`ImageDataset.set_epoch`). So the samples of
optimizer step i are the same whatever the world size, a distributed run can be checked against a
single-process run, and a resumed run can pick up in the middle of an epoch.
"""

import contextlib
import fcntl
import inspect
import itertools
import math
import multiprocessing
import os
import socket
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import BatchSampler, DataLoader, Dataset, Sampler, SequentialSampler, Subset

from common.utils import UsageError

CIFAR10_SHAPE = (3, 32, 32)
MNIST_SHAPE = (1, 28, 28)

# Sizes of the generated stand-in data. The test set size is not divisible by 2, 3, 4, 5 or 6,
# so that an evaluation that pads or drops samples across ranks is caught by `test_samples`.
SYNTHETIC_TRAIN_SIZE = 2400
SYNTHETIC_TEST_SIZE = 1001

_CROP_PADDING = 4

# How data-loader workers start: from a "forkserver", a process without threads that has imported torch
# (Python 3.14's default start method on Linux). A fork of the trainer itself, the default before 3.14,
# copies the locks of the trainer's other threads (gloo's, the autograd engine's) as they are at that
# instant: one held then is never released in the worker, which hangs before its first batch. Each worker
# still imports the script that runs (Python's rule for this start method), and this module with it, and
# receives the data set through shared memory: /dev/shm must hold it (docs/data-and-model.md).
WORKER_CONTEXT = multiprocessing.get_context("forkserver")
WORKER_CONTEXT.set_forkserver_preload(["torch"])


class EndWithTrainer:
    """A loader's `worker_init_fn` for workers started by WORKER_CONTEXT: each ends as soon as the process
    that created this object ends. PyTorch's workers watch their parent, which is the forkserver here, and
    the forkserver waits for its workers: after a trainer that ended without closing its loaders (a failed
    run that ends with `os._exit`, a SIGKILL), both would run forever. The trainer holds the write end of a
    pipe, which the system closes when it ends, however it ends; a thread in each worker waits for that.
    (Forked workers hold the write end too: PyTorch's own watch of their parent, the trainer, ends them.)"""

    _pipes = {}  # {the trainer's pid: (read end, write end)}, one pipe per trainer

    def __init__(self):
        if os.getpid() not in EndWithTrainer._pipes:
            EndWithTrainer._pipes = {os.getpid(): WORKER_CONTEXT.Pipe(duplex=False)}
        self.trainer_alive = EndWithTrainer._pipes[os.getpid()][0]

    def __call__(self, worker_id):
        threading.Thread(target=self._end_with_trainer, name="end with trainer", daemon=True).start()

    def _end_with_trainer(self):
        with contextlib.suppress(EOFError):
            self.trainer_alive.recv_bytes()  # nothing is ever sent: this returns when the trainer ends
        os._exit(0)


def worker_options(num_workers):
    """A `DataLoader`'s arguments for `num_workers` worker processes that start once, from WORKER_CONTEXT,
    serve every epoch (`persistent_workers`: a started worker imports the running script again) and end
    with their trainer."""
    if not num_workers:
        return {"num_workers": 0}
    WORKER_CONTEXT.set_forkserver_preload(_imports_of_main())  # before the first worker starts the server
    return {"num_workers": num_workers, "multiprocessing_context": WORKER_CONTEXT, "persistent_workers": True,
            "worker_init_fn": EndWithTrainer()}


def _imports_of_main():
    """torch and the modules of torch that the running script imported (DTensor, DCP, FSDP...): the forkserver
    imports them once, and each worker's import of the script then finds them done (a preload of "__main__",
    the script itself, does nothing before Python 3.13.8: CPython gh-126631). Other packages stay out: some ask
    at import whether CUDA is there (DeepSpeed), which the server must not; each worker imports them itself."""
    names = set()
    for value in vars(sys.modules["__main__"]).values():
        name = value.__name__ if inspect.ismodule(value) else getattr(value, "__module__", None)
        if isinstance(name, str) and name.startswith("torch.") and name in sys.modules:
            names.add(name)
    return ["torch", *sorted(names)]


class ImageDataset(Dataset):
    """uint8 images (N, C, H, W) and labels held in memory, served in whole batches (`BatchLoader`).

    With `augment=True`, each image is randomly shifted (zero padding of 4, then a crop back to the
    original size) and flipped left-right; the draws are a function of (seed, epoch, index) only.
    Call `set_epoch` before each epoch, like the sampler's.

    `dataset[indices]` (a list) returns the uint8 images, the labels and the augmentation draws of those
    samples; `prepare` then shifts, flips and normalises the whole batch, on whatever device it is.
    `dataset[i]` (an int) returns one prepared sample, for a classic `DataLoader` (docs/data-and-model.md).
    """

    def __init__(self, images, labels, mean, std, augment=False, seed=0):
        self.images = images
        self.labels = labels.long()
        self.mean = mean.view(1, -1, 1, 1)
        self.std = std.view(1, -1, 1, 1)
        self._stats_on_device = {}
        self.augment = augment
        self.seed = seed
        # The draws live in shared memory and `set_epoch` rewrites them in place: data-loader workers read
        # them, and workers that outlive an epoch (persistent_workers=True) must see the new epoch's draws.
        self.shifts = torch.empty(len(self), 2, dtype=torch.long).share_memory_()
        self.flips = torch.empty(len(self), dtype=torch.bool).share_memory_()
        self.set_epoch(0)

    def set_epoch(self, epoch):
        if self.augment:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            self.shifts.copy_(torch.randint(0, 2 * _CROP_PADDING + 1, (len(self), 2), generator=generator))
            self.flips.copy_(torch.rand(len(self), generator=generator) < 0.5)
        else:  # the draws that change nothing: no shift from the padded image's centre, no flip
            self.shifts.fill_(_CROP_PADDING)
            self.flips.fill_(False)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        if isinstance(index, list):
            return self.images[index], self.labels[index], self.shifts[index], self.flips[index]
        # One sample, by slicing: the same pixels as `prepare`, without a gather's set-up for one image.
        height, width = self.images.shape[-2:]
        top, left = self.shifts[index].tolist()
        image = F.pad(self.images[index], [_CROP_PADDING] * 4)[:, top:top + height, left:left + width]
        if self.flips[index]:
            image = image.flip(-1)
        return (image.to(torch.get_default_dtype()) / 255 - self.mean[0]) / self.std[0], self.labels[index]

    def prepare(self, images, labels, shifts, flips):
        """A batch from `dataset[indices]`, shifted, flipped and normalised on the device that holds it."""
        count, channels, height, width = images.shape
        padded = F.pad(images, [_CROP_PADDING] * 4).flatten(2)
        # Output pixel (y, x) of image n is padded pixel (top[n] + y, left[n] + x), x mirrored for the
        # flipped images: one gather for the whole batch.
        rows = shifts[:, :1] + torch.arange(height, device=images.device)
        columns = torch.arange(width, device=images.device).expand(count, width)
        columns = shifts[:, 1:] + torch.where(flips[:, None], columns.flip(-1), columns)
        pixels = rows[:, :, None] * (width + 2 * _CROP_PADDING) + columns[:, None, :]
        images = padded.gather(2, pixels.view(count, 1, -1).expand(-1, channels, -1)).view(images.shape)
        mean, std = self._stats_on(images.device)
        # the default dtype: float32, unless a run changes it (benchmarks/float64.py)
        return (images.to(torch.get_default_dtype()) / 255 - mean) / std, labels

    def _stats_on(self, device):
        """The mean and std on `device`, copied there once: on a GPU, a copy from pageable memory for every
        batch would make the CPU wait for the GPU to finish the previous step."""
        if device not in self._stats_on_device:
            self._stats_on_device[device] = self.mean.to(device), self.std.to(device)
        return self._stats_on_device[device]


class _BatchRange(Sampler):
    """The batches `start` to `stop` (exclusive) of `batch_sampler`: the index lists of the batches before
    `start` are drawn (so the order stays the same), their samples are never loaded."""

    def __init__(self, batch_sampler):
        self.batch_sampler, self.start, self.stop = batch_sampler, 0, None

    def __iter__(self):
        return itertools.islice(self.batch_sampler, self.start, self.stop)

    def __len__(self):
        return len(self.batch_sampler)


class BatchLoader:
    """A `DataLoader` for an `ImageDataset` that cuts whole batches: the indices of a batch (from
    `sampler`, or in order; or each list of `batch_sampler`) gather uint8 images in one operation, the
    batch crosses to `device` as uint8 (a quarter of float32's bytes), and is augmented and normalised
    there in a few tensor operations, instead of sample by sample in `__getitem__` and a collate.

    On a GPU the next batch is copied on a stream of its own while the current one trains."""

    def __init__(self, dataset, batch_size=None, sampler=None, batch_sampler=None, drop_last=False,
                 device="cpu", num_workers=0):
        self.images = dataset.dataset if isinstance(dataset, Subset) else dataset  # its `prepare`
        self.device = device = torch.device(device)
        if batch_sampler is None:
            batch_sampler = BatchSampler(sampler or SequentialSampler(dataset), batch_size, drop_last)
        self.batch_range = _BatchRange(batch_sampler)
        # batch_size=None: the loader hands each list of indices to the data set whole. Its own generator:
        # otherwise every epoch's iterator draws a seed from the global RNG, and a resumed run's random
        # numbers would no longer match an uninterrupted run's. The workers serve every epoch: the data
        # set's draws are in shared memory, so they see each epoch's.
        self.loader = DataLoader(dataset, batch_size=None, sampler=self.batch_range,
                                 **worker_options(num_workers), pin_memory=device.type == "cuda",
                                 generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.loader)

    @property
    def largest_batch(self):
        """The most samples that one of its batches holds (of a loader given its batches as a list)."""
        return max(map(len, self.batch_range.batch_sampler))

    def __iter__(self):
        return self.batches(0, len(self))

    def batches(self, start, stop):
        """This epoch's batches `start` to `stop` (exclusive), for a run that resumes mid-epoch or stops
        early: the batches before `start` are skipped without being loaded."""
        self.batch_range.start, self.batch_range.stop = start, stop
        if self.device.type != "cuda":
            for batch in self.loader:
                yield self.images.prepare(*(tensor.to(self.device) for tensor in batch))
            return
        # A copy from pinned memory with non_blocking=True runs beside the GPU's computation, but only on
        # another stream than the computation's: batch i + 1 is copied on `copy_stream` while batch i trains.
        copy_stream, compute_stream = torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)
        previous = None
        for batch in itertools.chain(self.loader, [None]):
            if batch is not None:
                with torch.cuda.stream(copy_stream):
                    copied = [tensor.to(self.device, non_blocking=True) for tensor in batch]
                    copy_done = torch.cuda.Event()
                    copy_done.record()
            if previous is not None:
                tensors, event = previous
                compute_stream.wait_event(event)  # the batch is on the device before it is used
                for tensor in tensors:  # its memory is not reused while the compute stream may still read it
                    tensor.record_stream(compute_stream)
                yield self.images.prepare(*tensors)
            previous = (copied, copy_done) if batch is not None else None


def _channel_stats(images):
    """Per-channel mean and std of uint8 images (N, C, H, W), in [0, 1] units."""
    pixels = images.transpose(0, 1).reshape(images.shape[1], -1).double() / 255
    return pixels.mean(dim=1).float(), pixels.std(dim=1).float()


def _datasets(train_images, train_labels, test_images, test_labels, seed, augment=True):
    mean, std = _channel_stats(train_images)
    train_set = ImageDataset(train_images, train_labels, mean, std, augment=augment, seed=seed)
    test_set = ImageDataset(test_images, test_labels, mean, std)
    return train_set, test_set


def make_synthetic(shape, num_train, num_test, num_classes=10, seed=0):
    """Generated stand-in images: deterministic for `seed`, learnable, never downloaded.

    Each class has a smooth colour pattern; a sample is its class's pattern under a random
    nuisance pattern, a brightness change and pixel noise, so a small net needs a
    few hundred steps to separate the classes well, and the first few dozen already beat chance.
    Returns uint8 images (N, C, H, W) and labels for the train and the test split.
    """
    channels, height, width = shape
    generator = torch.Generator().manual_seed(seed)

    def smooth(count, scale):
        coarse = torch.randn(count, channels, 4, 4, generator=generator) * scale
        return F.interpolate(coarse, size=(height, width), mode="bicubic", align_corners=False)

    prototypes = smooth(num_classes, 1.0)

    def split(count):
        labels = torch.arange(count) % num_classes
        labels = labels[torch.randperm(count, generator=generator)]
        images = prototypes[labels] + smooth(count, 1.3)
        images = images * (1 + 0.3 * torch.randn(count, 1, 1, 1, generator=generator))
        images = images + 0.8 * torch.randn(images.shape, generator=generator)
        return (images * 40 + 128).clamp(0, 255).to(torch.uint8), labels

    train_images, train_labels = split(num_train)
    test_images, test_labels = split(num_test)
    return train_images, train_labels, test_images, test_labels


def _check_data_dir(root):
    if os.path.exists(root) and not os.path.isdir(root):
        raise UsageError(f"--data-dir {root} is a file, not a directory")


def _cifar10_arrays(root):
    """The array layout: `train.npz` and `test.npz` holding `images` (N, 32, 32, 3) uint8 and `labels`."""
    paths = [os.path.join(root, name) for name in ("train.npz", "test.npz")]
    return paths if all(os.path.isfile(path) for path in paths) else None


@contextlib.contextmanager
def _one_process_at_a_time(root):
    """Hold a lock on `root`: of the processes that download into one directory (the ranks of a machine,
    or of every machine on a shared file system), one downloads while the others wait for it."""
    _check_data_dir(root)
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, ".download.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _download(dataset_class, root):
    """Best effort: a failure (no network, say) is reported by the `load_*` function, on every rank.

    Call it before the process group exists: a download can take longer than the group's timeout, and a
    rank left waiting in a collective past it kills the job. A process that waited for another's failed
    attempt does not try again: on a network that stalls, every try costs its timeouts. A data set that is
    already there is only checked, without the lock (its directory may be read-only)."""
    try:
        dataset_class(root, train=True, download=False)
        return
    except RuntimeError:  # not there, or not yet extracted
        pass
    waiting_since = time.time()
    try:
        with _one_process_at_a_time(root):
            failed = Path(root) / ".download-failed"
            if failed.exists() and failed.stat().st_mtime >= waiting_since:
                return
            previous_timeout = socket.getdefaulttimeout()
            socket.setdefaulttimeout(20)  # seconds without a byte: a network that drops packets would hang forever
            try:
                dataset_class(root, train=True, download=True)  # one download holds the training and the test split
            except (OSError, RuntimeError):
                failed.touch()
            finally:
                socket.setdefaulttimeout(previous_timeout)
    except PermissionError:  # a directory we may not write to: nothing can be downloaded into it
        pass


def _torchvision_splits(dataset_class, name, root):
    """torchvision's train and test split, already on disk; a clear error when they are not."""
    try:
        return dataset_class(root, train=True, download=False), dataset_class(root, train=False, download=False)
    except RuntimeError:
        raise UsageError(
            f"{name} is not in {os.path.abspath(root)} and could not be downloaded "
            "(no network?); download it where there is a network, or use --synthetic"
        ) from None


def download_cifar10(root):
    """Download CIFAR-10 into `root` if it is not there (best effort, before the process group: see
    `_download`)."""
    if os.path.isdir(root) and _cifar10_arrays(root):
        return
    import torchvision

    _download(torchvision.datasets.CIFAR10, root)


def load_cifar10(root, synthetic, seed=0):
    """The CIFAR-10 train and test sets (or the stand-in with `synthetic`), as `ImageDataset`s.

    Reads torchvision's layout (`cifar-10-batches-py/`, as `download_cifar10` leaves it) or the
    array layout of `_cifar10_arrays`. The training set augments, with draws keyed to `seed`.
    """
    if synthetic:
        return _datasets(*make_synthetic(CIFAR10_SHAPE, SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE), seed)
    _check_data_dir(root)
    arrays = _cifar10_arrays(root)
    if arrays:
        splits = []
        for path in arrays:
            with np.load(path) as npz:
                splits += [torch.from_numpy(npz["images"]).permute(0, 3, 1, 2).contiguous(),
                           torch.from_numpy(npz["labels"].astype(np.int64))]
        return _datasets(*splits, seed)
    import torchvision

    splits = []
    for split in _torchvision_splits(torchvision.datasets.CIFAR10, "CIFAR-10", root):
        splits += [torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous(), torch.tensor(split.targets)]
    return _datasets(*splits, seed)


def download_mnist(root):
    """Download MNIST into `root` (as `root/MNIST/raw/`) if it is not there (best effort, before the
    process group: see `_download`). With the four official archives already in `root/MNIST/raw/`,
    torchvision checks their md5 and extracts them, offline."""
    import torchvision

    _download(torchvision.datasets.MNIST, root)


def load_mnist(root, synthetic, seed=0):
    """The MNIST train and test sets (or an MNIST-shaped stand-in with `synthetic`), as `ImageDataset`s.

    Reads torchvision's layout (`MNIST/raw/`, as `download_mnist` leaves it). No augmentation, as in
    PyTorch's MNIST example: the small CNN reaches 98% in one epoch on the plain digits, and a
    left-right flip would turn some digits into others.
    """
    if synthetic:
        return _datasets(*make_synthetic(MNIST_SHAPE, SYNTHETIC_TRAIN_SIZE, SYNTHETIC_TEST_SIZE), seed, augment=False)
    _check_data_dir(root)
    import torchvision

    splits = []
    for split in _torchvision_splits(torchvision.datasets.MNIST, "MNIST", root):
        splits += [split.data.unsqueeze(1), split.targets]  # uint8 (N, 28, 28) -> (N, 1, 28, 28)
    return _datasets(*splits, seed, augment=False)


def equal_batches(dataset_size, world_size, rank, batch_size):
    """Batches of the indices in rank `rank`'s slice of a data set (samples rank, rank + world_size, ...),
    at most `batch_size` long, and as many on every rank: a slice one sample shorter than another could
    otherwise need one batch fewer. None is empty, so at a `batch_size` of 1 with slices of unequal length one
    batch holds 2 samples (08 pads to `BatchLoader.largest_batch`). The slices are disjoint and cover the data
    set: each sample counts once."""
    if dataset_size < world_size:
        raise UsageError(f"the test set has {dataset_size} samples, fewer than the {world_size} replicas that share it")
    longest_slice = math.ceil(dataset_size / world_size)
    count = min(math.ceil(longest_slice / batch_size), dataset_size // world_size)
    return [indices.tolist() for indices in torch.arange(rank, dataset_size, world_size).tensor_split(count)]


def pad_batch(images, labels, size):
    """`images` and `labels` with zeros appended up to `size` samples (08's pipeline schedule keeps the first
    batch's shape for every batch)."""
    missing = size - len(labels)
    return (torch.cat([images, images.new_zeros(missing, *images.shape[1:])]),
            torch.cat([labels, labels.new_zeros(missing)]))
