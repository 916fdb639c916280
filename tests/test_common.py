"""The shared pipeline: deterministic data, world-size-independent order, atomic writes."""

import argparse
import datetime
import itertools
import os
import signal
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from data_dirs import mnist_data_dir
from jobs import catches, run_job
from launch import ROOT, in_local_processes, python
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data.distributed import DistributedSampler

from common import data, distributed, flags, models, utils


@pytest.fixture(scope="module")
def synthetic():
    return data.load_cifar10(None, synthetic=True, seed=0)


def test_synthetic_data_is_deterministic_and_cifar_shaped(synthetic):
    train_set, test_set = synthetic
    again, _ = data.load_cifar10(None, synthetic=True, seed=0)
    assert torch.equal(train_set.images, again.images) and torch.equal(train_set.labels, again.labels)
    assert train_set.images.shape == (data.SYNTHETIC_TRAIN_SIZE, 3, 32, 32)
    assert train_set.images.dtype == torch.uint8
    assert sorted(train_set.labels.unique().tolist()) == list(range(10))
    image, label = test_set[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    # Padding mistakes in distributed evaluation must change the count at 2, 3 or 4 processes.
    assert all(len(test_set) % world_size for world_size in (2, 3, 4))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_global_batches_do_not_depend_on_world_size(world_size):
    """Step i's global batch holds the same samples at any world size (DistributedSampler + drop_last)."""
    dataset = range(1001)
    global_batch, epoch = 24, 3
    single = DistributedSampler(dataset, num_replicas=1, rank=0, seed=7)
    single.set_epoch(epoch)
    order = list(single)
    per_rank = []
    for rank in range(world_size):
        sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, seed=7, drop_last=True)
        sampler.set_epoch(epoch)
        per_rank.append(list(sampler))
    local = global_batch // world_size
    for step in range(len(dataset) // global_batch):
        distributed = sorted(i for indices in per_rank for i in indices[step * local:(step + 1) * local])
        assert distributed == sorted(order[step * global_batch:(step + 1) * global_batch])


def test_augmentation_depends_on_seed_epoch_and_index_only(synthetic):
    train_set, _ = synthetic
    train_set.set_epoch(5)
    first = [train_set[i][0] for i in range(8)]
    train_set.set_epoch(6)
    other_epoch = [train_set[i][0] for i in range(8)]
    fresh, _ = data.load_cifar10(None, synthetic=True, seed=0)
    fresh.set_epoch(5)
    assert all(torch.equal(a, fresh[i][0]) for i, a in enumerate(first))
    assert not all(torch.equal(a, b) for a, b in zip(first, other_epoch, strict=True))


def prepared_one_by_one(dataset, index):
    """What the pipeline did sample by sample before it worked on whole batches: pad by 4, crop the
    shifted 32x32 window, flip, normalise. The batched pipeline must give exactly this."""
    image = dataset.images[index]
    top, left = dataset.shifts[index].tolist()
    image = torch.nn.functional.pad(image, [4] * 4)[:, top:top + 32, left:left + 32]
    if dataset.flips[index]:
        image = image.flip(-1)
    return (image.to(torch.float32) / 255 - dataset.mean[0]) / dataset.std[0]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batches_are_the_samples_prepared_one_by_one(synthetic, num_workers):
    train_set, test_set = synthetic
    epoch, batch_size = 3, 64
    train_set.set_epoch(epoch)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=0)
    sampler.set_epoch(epoch)
    order = list(sampler)
    # Batches that mix shifts and flips: a gather that mixed up images would show.
    assert len(train_set.shifts[order[:batch_size]].unique(dim=0)) > 20 and 0 < train_set.flips.float().mean() < 1
    loader = data.BatchLoader(train_set, batch_size, sampler=sampler, drop_last=True, num_workers=num_workers)
    assert len(loader) == len(train_set) // batch_size
    for step, (images, labels) in enumerate(loader):
        batch = order[step * batch_size:(step + 1) * batch_size]
        assert torch.equal(images, torch.stack([prepared_one_by_one(train_set, i) for i in batch]))
        assert torch.equal(labels, train_set.labels[batch])
    # The test set: in order, unaugmented, the last batch short; a slice of it through a Subset.
    images = torch.cat([images for images, _ in data.BatchLoader(test_set, batch_size)])
    assert torch.equal(images, (test_set.images / 255 - test_set.mean) / test_set.std)
    shard = torch.utils.data.Subset(test_set, range(1, len(test_set), 3))
    labels = torch.cat([labels for _, labels in data.BatchLoader(shard, batch_size, num_workers=num_workers)])
    assert torch.equal(labels, test_set.labels[1::3])
    # One sample at a time, for a classic DataLoader.
    image, label = train_set[order[5]]
    assert torch.equal(image, prepared_one_by_one(train_set, order[5])) and label == train_set.labels[order[5]]


def test_array_layout_loads_real_images(tmp_path):
    rng = np.random.default_rng(0)
    for name, count in (("train", 50), ("test", 7)):
        np.savez(tmp_path / f"{name}.npz", images=rng.integers(0, 256, (count, 32, 32, 3), dtype=np.uint8),
                 labels=rng.integers(0, 10, count, dtype=np.uint8))
    train_set, test_set = data.load_cifar10(str(tmp_path), synthetic=False)
    assert (len(train_set), len(test_set)) == (50, 7)
    with np.load(tmp_path / "train.npz") as arrays:
        assert torch.equal(train_set.images[3], torch.from_numpy(arrays["images"][3]).permute(2, 0, 1))


@pytest.mark.parametrize("load, name", [(data.load_cifar10, "CIFAR-10"), (data.load_mnist, "MNIST")])
def test_missing_data_names_the_data_set_the_directory_and_synthetic(load, name, tmp_path):
    with pytest.raises(utils.UsageError, match="--synthetic") as error:
        load(str(tmp_path), synthetic=False)
    assert str(tmp_path) in str(error.value) and name in str(error.value)


def test_mnist_from_the_official_archives_offline(tmp_path):
    """torchvision's real path: md5 check and extraction of the four archives, no network."""
    data_dir = mnist_data_dir(tmp_path)
    data.download_mnist(str(data_dir))
    train_set, test_set = data.load_mnist(str(data_dir), synthetic=False)
    assert (len(train_set), len(test_set)) == (60_000, 10_000)
    assert train_set.images.shape == (60_000, 1, 28, 28) and train_set.images.dtype == torch.uint8
    assert train_set.labels[:5].tolist() == [5, 0, 4, 1, 9]  # the well-known first training digits
    assert not train_set.augment  # a flipped digit is another digit, or none
    # Normalised with the training set's statistics, the classic (0.1307, 0.3081).
    assert torch.allclose(train_set.mean.flatten(), torch.tensor([0.1307]), atol=1e-4)
    assert torch.allclose(train_set.std.flatten(), torch.tensor([0.3081]), atol=1e-4)


def test_synthetic_mnist_is_mnist_shaped():
    train_set, test_set = data.load_mnist(None, synthetic=True, seed=0)
    assert train_set.images.shape == (data.SYNTHETIC_TRAIN_SIZE, *data.MNIST_SHAPE)
    assert len(test_set) == data.SYNTHETIC_TEST_SIZE
    assert sorted(train_set.labels.unique().tolist()) == list(range(10))
    assert models.MnistCNN()(torch.stack([test_set[i][0] for i in range(2)])).shape == (2, 10)


def test_the_run_record_takes_the_parallel_layout_from_the_mesh(monkeypatch):
    """08-11 pass no layout of their own: the record reads its sizes from the device mesh, in metrics.json's order
    (the replicas' dimension, "dp" or "edp", left out: the world size implies it)."""
    monkeypatch.delenv("RANK", raising=False)
    sizes = {"pp": 2, "dp": 3}

    class Mesh:  # a DeviceMesh's names and sizes, without a process group
        mesh_dim_names = tuple(sizes)

        def __getitem__(self, name):
            return types.SimpleNamespace(size=lambda: sizes[name])

    args = argparse.Namespace(epochs=1, synthetic=True, batch_size=24, amp="none")
    context = utils.Context(args, torch.device("cpu"), world_size=6, mesh=Mesh())
    record = utils.RunRecord("/any/08_cifar10_pipeline.py", context, 10, microbatches=4, schedule="1f1b")
    assert record.settings == {"script": "08_cifar10_pipeline.py", "data": "synthetic", "device": "cpu",
                               "amp": "none", "world_size": 6, "stages": 2, "microbatches": 4, "schedule": "1f1b",
                               "global_batch_size": 24}
    assert list(record.settings)[4:8] == ["world_size", "stages", "microbatches", "schedule"]


def test_the_run_record_prints_rank_0s_lines_and_holds_metrics_jsons_contents(capsys, monkeypatch):
    monkeypatch.delenv("RANK", raising=False)  # rank 0, as in one process without a launcher
    args = argparse.Namespace(epochs=3, synthetic=True, batch_size=24, amp="bf16")
    context = utils.Context(args, torch.device("cpu"), world_size=2)
    record = utils.RunRecord("/any/05_cifar10_deepspeed.py", context, 10, zero_stage=3)
    for epoch in (0, 1):
        record.start_training(10 * epoch)
        record.stop_training(10 * (epoch + 1))
        record.end_epoch(epoch, 10 * (epoch + 1), 2.0 - epoch, 1.5 - epoch / 2, 0.25 * (epoch + 1), 1001)
    metrics = record.metrics()
    assert list(metrics) == ["script", "data", "device", "amp", "world_size", "zero_stage", "global_batch_size",
                             "steps", "epochs_completed", "train_loss", "test_loss", "test_accuracy", "test_samples",
                             "samples_per_second", "wall_seconds", "history"]
    assert metrics | {"samples_per_second": 0, "wall_seconds": 0, "history": []} == {
        "script": "05_cifar10_deepspeed.py", "data": "synthetic", "device": "cpu", "amp": "bf16", "world_size": 2,
        "zero_stage": 3, "global_batch_size": 24, "steps": 20, "epochs_completed": 2, "train_loss": 1.0,
        "test_loss": 1.0, "test_accuracy": 0.5, "test_samples": 1001, "samples_per_second": 0, "wall_seconds": 0,
        "history": []}
    assert metrics["samples_per_second"] == 480 / record.seconds  # the timed spans alone
    assert [entry["step"] for entry in metrics["history"]] == [10, 20]
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[1].startswith("epoch 2/3  step 20  train_loss 1.0000  test_loss 1.0000  "
                                                   "test_accuracy 0.5000  samples/s "), lines
    monkeypatch.setenv("RANK", "1")  # another rank, before the process group exists
    record.end_epoch(2, 30, 0.5, 0.5, 0.75, 1001)
    assert capsys.readouterr().out == ""
    with pytest.raises(utils.UsageError, match="the test loss is nan at step 40"):
        record.end_epoch(3, 40, 0.5, float("nan"), 0.75, 1001)


def test_atomic_save_keeps_the_previous_file_when_a_write_crashes(tmp_path, monkeypatch):
    path = tmp_path / "checkpoint.pt"
    utils.save_atomic({"step": 1}, path)

    def crash_mid_write(obj, file):
        file.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as if the process were interrupted while writing

    monkeypatch.setattr(torch, "save", crash_mid_write)
    with pytest.raises(KeyboardInterrupt):
        utils.save_atomic({"step": 2}, path)
    monkeypatch.undo()
    assert utils.load_checkpoint(path, map_location="cpu") == {"step": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary file left behind


@pytest.mark.parametrize("damage", ["truncate", "garbage"])
def test_damaged_checkpoint_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "checkpoint.pt"
    utils.save_atomic({"model": models.ResNet9().state_dict()}, path)
    content = path.read_bytes()
    path.write_bytes(content[: len(content) // 2] if damage == "truncate" else b"not a checkpoint" * 10)
    with pytest.raises(utils.UsageError, match="corrupt or truncated"):
        utils.load_checkpoint(path, map_location="cpu")


def test_checkpoint_from_other_settings_is_refused():
    with pytest.raises(utils.UsageError, match="--batch-size"):
        utils.check_resumable("DIR/checkpoint.pt", {"batch_size": 256, "epochs": 10}, batch_size=128, epochs=10)
    with pytest.raises(utils.UsageError, match="same number of processes"):
        utils.check_resumable("DIR/checkpoint.pt", {"world_size": 2}, world_size=3)
    with pytest.raises(utils.UsageError, match="does not record its --norm; use a new --output-dir"):
        utils.check_resumable("DIR/checkpoint.pt", {"batch_size": 256}, batch_size=256, norm="batch")


def test_strict_deterministic_mode_refuses_a_cublas_workspace_it_cannot_use(monkeypatch):
    """Strict (09, 10), cuBLAS would stop at the first product with a traceback on every rank: one error line
    instead, before the mode changes (torch's deterministic setting stays as it was)."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    with pytest.raises(utils.UsageError, match="CUBLAS_WORKSPACE_CONFIG=:0:0: deterministic cuBLAS needs"):
        utils.use_deterministic_kernels(strict=True)
    assert not torch.are_deterministic_algorithms_enabled()


def test_model_is_the_documented_size_and_shape():
    model = models.ResNet9()
    assert models.count_parameters(model) == 1_646_122
    assert model(torch.zeros(2, 3, 32, 32)).shape == (2, 10)


def test_the_mixture_of_experts_weighs_each_tokens_top_k_experts():
    """Step 11's MLP against a token-by-token reference, in float64: the same outputs and the same gradients;
    every assignment counted, none dropped; the balance loss, its gradient and its range."""
    torch.manual_seed(0)
    layer = models.MixtureOfExperts(width=8, hidden=16, experts=4, top_k=2).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    output = layer(x)
    tokens = x.reshape(-1, 8)
    weights, chosen = layer.router(tokens).softmax(dim=-1).topk(2, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    up, down = layer.experts.up, layer.experts.down
    expected = torch.stack([sum(weights[token, j] * (F.gelu(tokens[token] @ up[expert]) @ down[expert])
                                for j, expert in enumerate(chosen[token])) for token in range(len(tokens))])
    assert torch.allclose(output.reshape(-1, 8), expected, rtol=0, atol=1e-12)
    assert layer.tokens_per_expert.tolist() == chosen.flatten().bincount(minlength=4).tolist()
    assert layer.tokens_per_expert.sum() == 15 * 2
    gradients = torch.autograd.grad(output.sum(), list(layer.parameters()))
    for gradient, reference in zip(gradients, torch.autograd.grad(expected.sum(), list(layer.parameters())),
                                   strict=True):
        assert torch.allclose(gradient, reference, rtol=0, atol=1e-12)
    # The balance loss against its formula, E x sum(fraction of the assignments x mean probability), and so is
    # its gradient, which reaches the router through the probabilities alone: this forward's counts, or another
    # batch's (step 11 passes the whole batch's).
    layer(x)
    probabilities = layer.router(tokens).softmax(dim=-1)
    for counts in (None, torch.tensor([7, 0, 30, 3])):
        fractions = (chosen.flatten().bincount(minlength=4) if counts is None else counts) / (30 if counts is None
                                                                                               else 40)
        reference = 4 * (fractions * probabilities.mean(dim=0)).sum()
        loss = layer.balance_loss(counts)
        assert abs(loss.item() - reference.item()) < 1e-12
        gradient, = torch.autograd.grad(loss, layer.router.weight, retain_graph=True)
        expected_gradient, = torch.autograd.grad(reference, layer.router.weight, retain_graph=True)
        assert torch.allclose(gradient, expected_gradient, rtol=0, atol=1e-12)
    # Its range: 1 for an even load, experts / top_k when top_k experts take every assignment.
    with torch.no_grad():
        layer.router.weight.zero_()  # every expert equally likely
    layer(x)
    assert abs(layer.balance_loss(torch.tensor([1, 1, 1, 1])).item() - 1) < 1e-12
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([1e3, 1e3, -1e3, -1e3])[:, None].expand(4, 8))
    layer(x.abs())  # experts 0 and 1 take everything, each with a probability of 1/2
    assert layer.tokens_per_expert.tolist() == [15, 15, 0, 0]
    assert abs(layer.balance_loss().item() - 4 / 2) < 1e-12


def test_the_mixture_of_experts_repeats_its_gradients_bit_for_bit_on_several_threads():
    """Each token goes to top_k experts, so its gradient is the sum of top_k parts. On several threads, an
    index's backward (`tokens[order]`) adds them with atomics, in an order that changes from run to run; the
    layer's must not (a resume would not be exact). With `tokens[order]`, 4 threads and top_k 8 gave another
    gradient within 12 repeats in 10 runs of 10 on the 2-core development CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(4)  # under two pytest workers the tests run on one (conftest.py): atomics need several
    try:
        torch.manual_seed(0)
        layer = models.MixtureOfExperts(width=128, hidden=64, experts=8, top_k=8)
        x = torch.randn(32, 64, 128, requires_grad=True)
        gradients = [torch.autograd.grad(layer(x).square().sum(), x)[0] for _ in range(12)]
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(gradients[0], gradient) for gradient in gradients[1:])


def test_the_experts_take_the_tokens_of_several_ranks_in_one_table():
    """Under expert parallelism (step 11) an expert's tokens arrive from several ranks: `counts` is a table (rank,
    expert) of the tokens sorted by rank, then by expert. Each token goes through its expert's MLP as alone."""
    torch.manual_seed(0)
    experts = models.Experts(width=8, hidden=16, experts=2).double()
    tokens, table = torch.randn(10, 8, dtype=torch.float64), torch.tensor([[3, 1], [0, 6]])
    chosen = [0, 0, 0, 1, 1, 1, 1, 1, 1, 1]  # rank 0: 3 for expert 0, 1 for expert 1; rank 1: 6 for expert 1
    expected = torch.stack([F.gelu(token @ experts.up[e]) @ experts.down[e] for token, e in zip(tokens, chosen,
                                                                                                  strict=True)])
    assert torch.allclose(experts(tokens, table), expected, rtol=0, atol=1e-12)


def test_group_norm_makes_each_sample_independent_of_its_batch():
    """What --norm group is for: in training mode, BatchNorm's output for a sample depends on the
    other samples of its batch (so on how a batch is split across processes); GroupNorm's does not."""
    images = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    for norm, independent in (("batch", False), ("group", True)):
        model = models.ResNet9(norm=norm).double().train()
        assert models.count_parameters(model) == 1_646_122
        whole, halves = model(images), torch.cat([model(images[:2]), model(images[2:])])
        assert torch.allclose(whole, halves, rtol=1e-12, atol=1e-12) == independent, norm


def test_mnist_cnn_is_pytorchs_example_net(tmp_path):
    model = models.MnistCNN()
    # conv 1->32 (320) + conv 32->64 (18,496) + linear 9,216->128 (1,179,776) + linear 128->10 (1,290)
    assert models.count_parameters(model) == 1_199_882
    assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    path = tmp_path / "model.pt"
    utils.save_atomic(model.state_dict(), path)
    loaded = models.load_weights(path, models.MnistCNN).state_dict()
    assert all(torch.equal(tensor, loaded[name]) for name, tensor in model.state_dict().items())


class CopiesToDevice(TorchDispatchMode):
    """Records the shape of every tensor that a copy takes from the CPU to another device."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default):
            source = args[1] if func is torch.ops.aten.copy_.default else args[0]
            if source.device.type == "cpu" and result.device.type != "cpu":
                self.shapes.append(tuple(source.shape))
        return result


def test_only_the_batch_crosses_to_the_device(synthetic):
    """Per batch, the uint8 images, the labels and the augmentation draws go to the device, nothing else:
    the normalisation constants are copied once (on a GPU, a copy from pageable memory in every batch
    makes the CPU wait for the GPU). The `meta` device stands in for a GPU: the same copies, no data."""
    train_set, _ = synthetic
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0)
    loader = data.BatchLoader(train_set, 64, sampler=sampler, device="meta")
    with CopiesToDevice() as copies:
        batches = sum(1 for _ in itertools.islice(loader, 5))
    per_batch = [(64, 3, 32, 32), (64,), (64, 2), (64,)]
    stats_once = [(1, 3, 1, 1), (1, 3, 1, 1)]
    assert sorted(copies.shapes) == sorted(per_batch * batches + stats_once)


class CountedLoads(torch.utils.data.Dataset):
    """A data set that counts the batches it loads (lists of indices, as BatchLoader asks for them)."""

    def __init__(self, dataset):
        self.dataset, self.loaded = dataset, []

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, indices):
        self.loaded.append(indices)
        return self.dataset[indices]

    def prepare(self, *batch):
        return self.dataset.prepare(*batch)


def test_a_resumed_epoch_skips_batches_without_loading_them(synthetic):
    train_set, _ = synthetic
    counted = CountedLoads(train_set)
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=3)
    whole_epoch = [images for images, _ in data.BatchLoader(counted, 24, sampler=sampler, drop_last=True)]
    counted.loaded.clear()
    resumed = [images for images, _ in data.BatchLoader(counted, 24, sampler=sampler, drop_last=True).batches(7, 10)]
    assert len(counted.loaded) == 3  # batches 7, 8 and 9: the first 7 were never loaded
    assert all(torch.equal(a, b) for a, b in zip(resumed, whole_epoch[7:10], strict=True))


def test_the_forkserver_preloads_the_modules_of_torch_that_the_script_imported(monkeypatch):
    """Each loader worker imports the script again: the server has imported its modules of torch (by a module or
    by a name from it) before it forks them. Other packages stay out (DeepSpeed asks about CUDA at import), and
    so do the script's own names."""
    import torch.distributed.checkpoint as dcp
    import yaml
    from torch.distributed.fsdp import fully_shard

    script = types.ModuleType("__main__")
    script.dcp, script.fully_shard, script.F, script.yaml, script.steps = dcp, fully_shard, F, yaml, 3
    script.main = types.FunctionType((lambda: None).__code__, script.__dict__, "main")  # the script's own function
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert data._imports_of_main() == ["torch", *sorted(
        ["torch.distributed.checkpoint", fully_shard.__module__, "torch.nn.functional"])]


def test_persistent_workers_see_each_epochs_augmentation(synthetic):
    """BatchLoader keeps its worker processes from epoch to epoch: the draws of `set_epoch` must reach them (a
    copy of the draws made when they started would repeat epoch 0's). Each epoch stops after 3 batches, as a
    run that resumes or stops mid-epoch does."""
    train_set, _ = synthetic
    sampler = DistributedSampler(train_set, num_replicas=1, rank=0, seed=1)
    persistent = data.BatchLoader(train_set, 64, sampler=sampler, num_workers=2)
    epochs = []
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            train_set.set_epoch(epoch)
            epochs.append([images for images, _ in itertools.islice(persistent, 3)])
        fresh = [images for images, _ in itertools.islice(data.BatchLoader(train_set, 64, sampler=sampler), 3)]
    finally:
        train_set.set_epoch(0)  # the module's other tests expect epoch 0's draws
    assert all(torch.equal(a, b) for a, b in zip(epochs[1], fresh, strict=True))
    assert not torch.equal(epochs[0][0], epochs[1][0])


def test_a_checkpoint_restores_on_fewer_visible_gpus(monkeypatch):
    """Each process saves its own GPU's generator: a run saved where 8 GPUs were visible resumes where one
    is (an 8-GPU run of 03 resumed with CUDA_VISIBLE_DEVICES=0). No GPU needed: torch.cuda is faked."""
    generators = {index: torch.tensor([index], dtype=torch.uint8) for index in range(8)}
    current = {"device": 5}

    def get_rng_state(device="cuda"):
        return generators[current["device"]].clone()

    def set_rng_state(state, device="cuda"):
        if current["device"] >= len(generators):
            raise IndexError("no such GPU")
        generators[current["device"]] = state

    def get_rng_state_all():
        return [generators[index].clone() for index in range(len(generators))]

    def set_rng_state_all(states):
        for index, state in enumerate(states):
            if index >= len(generators):
                raise IndexError("no such GPU")
            generators[index] = state

    for name, function in [("is_available", lambda: True), ("get_rng_state", get_rng_state),
                           ("set_rng_state", set_rng_state), ("get_rng_state_all", get_rng_state_all),
                           ("set_rng_state_all", set_rng_state_all)]:
        monkeypatch.setattr(torch.cuda, name, function)
    state = utils.get_rng_state()
    assert torch.equal(state["cuda"], torch.tensor([5], dtype=torch.uint8))
    for index in range(1, 8):  # CUDA_VISIBLE_DEVICES=0: one GPU, device 0
        del generators[index]
    generators[0] = torch.tensor([0], dtype=torch.uint8)
    current["device"] = 0
    utils.set_rng_state(state)
    assert torch.equal(generators[0], torch.tensor([5], dtype=torch.uint8))


@pytest.mark.parametrize(("resume", "restarted", "seen_by", "expected"), [
    (False, (0, 1), (0, 1), "resumes"),
    (False, (1,), (0, 1), "resumes"),  # rank 0's torchrun restarted running workers without counting
    (False, (0, 1), (0,), "rank(s) 1 cannot see"),  # no file system shared with rank 0
    (False, (0, 1), (1,), "rank(s) 0 cannot see"),  # rank 0 on a machine without it: not a silent start over
    (False, (0, 1), (), "starts over"),  # restarted before the first checkpoint
    (True, (), (1,), "rank(s) 0 cannot see"),  # --resume, and rank 0 alone cannot see it
    (False, (), (0, 1), "starts over"),  # neither --resume nor a restart: a first run in a used folder
])
def test_every_rank_takes_the_same_decision_to_resume(resume, restarted, seen_by, expected, tmp_path, monkeypatch):
    """Every rank passes the same path; each resolves it in a folder of its own, as on machines without a
    shared file system. The decision, or the error, is the same on every rank."""
    for rank in seen_by:
        (tmp_path / str(rank)).mkdir()
        (tmp_path / str(rank) / "checkpoint.pt").write_bytes(b"")
    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)

    def decide(rank):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = "1" if rank in restarted else "0"
        os.chdir(tmp_path / str(rank) if rank in seen_by else tmp_path)
        try:
            return "resumes" if distributed.should_resume(resume, "checkpoint.pt") else "starts over"
        except utils.UsageError as error:
            return str(error)

    decisions = in_local_processes(decide, 2, datetime.timedelta(seconds=60))
    assert decisions[0] == decisions[1] and expected in decisions[0]


def test_one_process_downloads_while_the_others_wait(tmp_path):
    """The processes of a machine share --data-dir: one downloads at a time, and those that waited for a
    failed attempt do not try again (each try on a stalling network costs its timeouts)."""
    attempts, running = [], []

    class FailingDownload:
        def __init__(self, root, train, download):
            if not download:
                raise RuntimeError("Dataset not found")  # as torchvision's classes say it
            assert not running, "two downloads at once"
            running.append(1)
            attempts.append(root)
            time.sleep(2)  # long enough for the other threads to be waiting for the lock, on a busy machine too
            running.pop()
            raise RuntimeError("no network")

    threads = [threading.Thread(target=data._download, args=(FailingDownload, str(tmp_path))) for _ in range(3)]
    for thread in threads:
        thread.start()
        time.sleep(0.05)  # the first one holds the lock: the others wait for it
    for thread in threads:
        thread.join(timeout=30)
    assert len(attempts) == 1
    data._download(FailingDownload, str(tmp_path))  # a later run tries again
    assert len(attempts) == 2


@pytest.mark.parametrize("argv, lr", [([], 0.2), (["--batch-size", "64"], 0.05),
                                      (["--batch-size", "64", "--lr", "0.3"], 0.3)])
def test_the_default_learning_rate_follows_the_global_batch(argv, lr):
    """0.2 at the default global batch of 256, scaled linearly; a given --lr is kept as it is."""
    parser = flags.build_parser("04_cifar10_ddp.py", "", epochs=10, batch_size=256, lr=0.2)
    assert parser.parse_args(argv).lr == pytest.approx(lr)


def run_script(tmp_path, source, *args, launcher=(), env=None, timeout=60, **options):
    """`python [LAUNCHER] SCRIPT ARGS` for the Python `source`, written to a file, with the repository importable."""
    script = tmp_path / "script.py"
    script.write_text(source)
    return run_job(python(*launcher, script, *args), env={"PYTHONPATH": str(ROOT), **(env or {})}, timeout=timeout,
                   **options)


# Started after `Preemption`, a loader's worker process reports its blocked signals from /proc (SigBlk); a sample
# that raises ends the run through utils.run, which must not wait for the workers (they ignore SIGTERM), and the
# workers end with it (the test waits for every process that holds its output).
LOADER_WORKER_SIGNALS = """
import sys

import torch
from torch.utils.data import DataLoader, Dataset

from common import data, distributed, utils


class BlockedSignals(Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, index):
        if sys.argv[2] == "fail" and index == 3:
            raise ValueError("a broken sample")
        blocked = int(open("/proc/self/status").read().split("SigBlk:")[1].split()[0], 16)
        return torch.tensor([blocked >> (number - 1) & 1 for number in distributed.Preemption.STOP_SIGNALS])


def main():
    distributed.Preemption()
    for batch in DataLoader(BlockedSignals(), batch_size=2, num_workers=2, multiprocessing_context=sys.argv[1],
                            worker_init_fn=data.EndWithTrainer()):
        print(batch.tolist())


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)
"""


@pytest.mark.full
@pytest.mark.parametrize("start_method", ["fork", "forkserver", "spawn"])
def test_forked_or_spawned_loader_workers_never_act_on_the_stop_signals(start_method, tmp_path):
    """SIGTERM and SIGUSR1 are blocked in the loader's workers from their start, whether they are forked (Linux's
    default up to Python 3.13), started by a forkserver (the steps', and 3.14's default) or spawned. A run whose
    data set fails ends with the error, exit status 1, and does not wait for its workers, which end with it."""
    result = run_script(tmp_path, LOADER_WORKER_SIGNALS, start_method, "ok", timeout=120)
    assert result.returncode == 0 and result.stdout.split("\n")[:2] == ["[[1, 1], [1, 1]]"] * 2, result.stderr
    failed = run_script(tmp_path, LOADER_WORKER_SIGNALS, start_method, "fail")
    assert failed.returncode == 1 and "ValueError: a broken sample" in failed.stderr, failed.stderr[-3000:]


# A data set that takes a lock, which another thread of the trainer holds while the loader runs. A worker forked from
# the trainer starts with the lock held and no thread to release it, as with the locks of gloo's and PyTorch's
# threads (common/data.py); a worker started by the forkserver imports this script afresh, with a lock of its own.
LOCK_HELD_BY_ANOTHER_THREAD = """
import threading

import torch

from common import data

LOCK = threading.Lock()


class NeedsTheLock(data.ImageDataset):
    def __getitem__(self, indices):
        with LOCK:
            return super().__getitem__(indices)


def hold(held):
    with LOCK:
        held.set()
        threading.Event().wait()


def main():
    images, labels, _, _ = data.make_synthetic(data.CIFAR10_SHAPE, 1000, 10)
    dataset = NeedsTheLock(images, labels, torch.zeros(3), torch.ones(3))
    held = threading.Event()
    threading.Thread(target=hold, args=(held,), daemon=True).start()
    held.wait()
    print(sum(len(labels) for _, labels in data.BatchLoader(dataset, 100, num_workers=2)))


if __name__ == "__main__":
    main()
"""


def test_loader_workers_never_inherit_a_lock_that_another_thread_holds(tmp_path):
    """BatchLoader's workers are not forks of the trainer, whose other threads may hold a lock at that instant."""
    result = run_script(tmp_path, LOCK_HELD_BY_ANOTHER_THREAD)
    assert result.returncode == 0 and result.stdout == "1000\n", result.stderr[-3000:]


# A process that is not the first of its machine finds bad input, without torchrun: it prints nothing and waits
# for the first to print, until a launcher's SIGTERM (here the test's) asks it to stop.
BAD_INPUT_ON_LOCAL_RANK_1 = """
from common import distributed, utils


def main():
    distributed.Preemption()
    raise utils.UsageError("a bad --batch-size")


if __name__ == "__main__":
    utils.run(main, skip_python_shutdown=True)
"""


@pytest.mark.parametrize("signalled", [pytest.param(False, marks=pytest.mark.full), True])
def test_bad_input_on_another_rank_waits_for_the_first_or_a_stop_signal(signalled, tmp_path):
    """DeepSpeed's launcher and `srun --kill-on-bad-exit` stop every process once one has failed: the ranks that
    do not print the `error:` line wait (10 s) so that the first has printed it when they are stopped, and end
    with its status at once on the launcher's SIGTERM, which Preemption keeps from ending them."""
    signalled_at = []

    def sigterm_once_handled(process):
        if signalled and not signalled_at and catches(process.pid, signal.SIGTERM):
            process.send_signal(signal.SIGTERM)
            signalled_at.append(time.monotonic())

    started = time.monotonic()
    result = run_script(tmp_path, BAD_INPUT_ON_LOCAL_RANK_1, env={"LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"},
                        poll=sigterm_once_handled)
    waited = time.monotonic() - (signalled_at[0] if signalled else started)
    assert result.returncode == 2 and "error:" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert signalled_at or not signalled, "the run ended before it handled SIGTERM"
    # The wait is 10 s, and the signal ends it when it arrives.
    assert (waited < utils.BAD_INPUT_WAIT_SECONDS / 2) if signalled else (waited > utils.BAD_INPUT_WAIT_SECONDS), waited


# SIGUSR1, pending before `Preemption()`: every thread blocks it, and multiprocessing's resource tracker, which
# `Preemption` starts, unblocks SIGINT and SIGTERM only. The waiting thread takes it as soon as it starts; the
# thread that started it then sleeps, so that a signal the thread received before it knew its instance was lost.
SIGNAL_PENDING_AT_THE_START = """
import os, signal, threading, time

from common import distributed, utils

start = threading.Thread.start
threading.Thread.start = lambda thread: (start(thread), time.sleep(0.2))
os.kill(os.getpid(), signal.SIGUSR1)
distributed.Preemption()
print(utils.STOP_REQUESTED.wait(10), flush=True)
os._exit(0)
"""


def test_a_stop_signal_pending_when_preemption_starts_is_received(tmp_path):
    """A launcher can start a process with the stop signals blocked in every thread (exec keeps the mask): one
    sent before `Preemption()` stays pending, and its waiting thread receives it."""
    blocked_exec = ("import os, signal, sys; signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1]); "
                    "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
    result = run_script(tmp_path, SIGNAL_PENDING_AT_THE_START, launcher=("-c", blocked_exec))
    assert result.returncode == 0 and result.stdout == "True\n" and not result.stderr, result.stderr[-3000:]


# The stop signals sent to the resource tracker that `Preemption` starts, as torchrun (to the worker's process
# group) and Slurm (to the job step) send them: it ignores SIGTERM, and keeps SIGUSR1 blocked.
STOP_SIGNALS_TO_THE_RESOURCE_TRACKER = """
import os, signal, time
from multiprocessing import resource_tracker

from common import distributed

distributed.Preemption()
tracker = resource_tracker._resource_tracker._pid
for number in (signal.SIGUSR1, signal.SIGTERM):
    os.kill(tracker, number)
time.sleep(1)
print(os.waitpid(tracker, os.WNOHANG) == (0, 0), flush=True)
os._exit(0)
"""


def test_the_resource_tracker_outlives_the_stop_signals(tmp_path):
    """Dead, the tracker would be started again by the next loader, with a warning, and would unblock SIGTERM in
    the thread that starts it."""
    result = run_script(tmp_path, STOP_SIGNALS_TO_THE_RESOURCE_TRACKER)
    assert result.returncode == 0 and result.stdout == "True\n" and not result.stderr, result.stderr[-3000:]


@pytest.mark.parametrize("metrics, step, last_step, expected", [
    (None, 14, 14, False),  # no outputs: evaluate and write them
    ('{"steps": 10}', 14, 14, False),  # an earlier, shorter run's outputs
    ('{"steps": 14}', 14, 14, True),
    ('{"steps": 14}', 14, 10, True),  # --max-steps lowered below the checkpoint's step
    ('{"steps": 14}', 12, 14, False),  # steps left to train
    ('{"steps": ', 14, 14, False),  # unreadable
    ('[14]', 14, 14, False),
])
def test_a_run_started_again_after_its_end_is_finished_only_with_that_steps_outputs(metrics, step, last_step,
                                                                                   expected, tmp_path, capsys):
    if metrics is not None:
        (tmp_path / "metrics.json").write_text(metrics)
    assert utils.finished(str(tmp_path), step, last_step) == expected
    said = {(14, 14): f"nothing to train: {tmp_path} holds step 14 of 14\n",
            (14, 10): f"nothing to train: {tmp_path} holds step 14, past --max-steps 10\n"}
    assert capsys.readouterr().out == (said[step, last_step] if expected else "")
