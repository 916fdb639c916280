"""Small data sets of any size in the layouts the steps read, and the official MNIST archives."""

import shutil

import numpy as np
import pytest
from launch import SHARED_DATA


def tiny_cifar10(data_dir, train_size, test_size):
    """A --data-dir in the array layout (common/data.py) with random images: a data set of any size."""
    data_dir.mkdir()
    generator = np.random.default_rng(0)
    for name, size in (("train", train_size), ("test", test_size)):
        np.savez(data_dir / f"{name}.npz", images=generator.integers(0, 256, (size, 32, 32, 3), dtype=np.uint8),
                 labels=generator.integers(0, 10, size, dtype=np.uint8))
    return data_dir


def tiny_mnist(data_dir, train_size, test_size):
    """A --data-dir in torchvision's MNIST layout (the four IDX files, uncompressed, in MNIST/raw/)
    with random digits: a data set of any size, which torchvision loads offline."""
    raw = data_dir / "MNIST" / "raw"
    raw.mkdir(parents=True)
    generator = np.random.default_rng(0)
    for name, size in (("train", train_size), ("t10k", test_size)):
        images = generator.integers(0, 256, (size, 28, 28), dtype=np.uint8)
        labels = generator.integers(0, 10, size, dtype=np.uint8)
        # IDX: a magic number (0x08 = unsigned bytes, then the number of dimensions), the sizes as
        # big-endian int32, the data.
        for kind, array in (("images-idx3", images), ("labels-idx1", labels)):
            header = np.array([0x0800 + array.ndim, *array.shape], dtype=">i4").tobytes()
            (raw / f"{name}-{kind}-ubyte").write_bytes(header + array.tobytes())
    return data_dir


def mnist_data_dir(tmp_path):
    """A fresh --data-dir holding only the official MNIST archives (from ../shared/data), as
    torchvision's download leaves them: loading then runs torchvision's real path (md5 check,
    extraction), offline. Skips the test where ../shared is absent (a user's checkout)."""
    archives = SHARED_DATA / "MNIST" / "raw"
    if not archives.is_dir():
        pytest.skip(f"the MNIST archives are not in {archives}: the tests need ../shared/data beside the checkout")
    data_dir = tmp_path / "data"
    shutil.copytree(archives, data_dir / "MNIST" / "raw")
    return data_dir
