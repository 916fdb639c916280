"""Step 10: each image's tokens split across ranks: context parallelism on a 2D mesh, and FSDP2.

New (relative to step 09; lines marked `# [10]`): a group of `--cp-size` ranks shares every image,
each rank holding 64 / C of its tokens from the embedding on. The norms, the MLP and every
projection work token by token, so each rank runs them on its own tokens alone; attention, the one
layer where tokens meet, gathers every token's keys and values from the group (as Llama 3 trained),
and the head gathers every token's features. The group sees the same batch; world size /
`--cp-size` such groups split each batch. FSDP2 shards the weights over every rank. No GPU: gloo on
the CPU.

Launch:
    torchrun --nproc_per_node=N 10_cifar10_context_parallel.py --cp-size 2 --amp bf16  # N GPUs
    torchrun --standalone --nproc_per_node=2 10_cifar10_context_parallel.py --synthetic  # CPU
    torchrun --standalone --nproc_per_node=4 10_cifar10_context_parallel.py --synthetic  # cp 2 dp 2
"""

import os

import torch
import torch.distributed as dist  # [04]
import torch.distributed._functional_collectives as funcol  # [10] collectives that autograd follows
import torch.distributed.checkpoint as dcp  # [07]
import torch.distributed.checkpoint.state_dict as dcp_state  # [07] the sharded state, in and out
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh  # [09]
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # [07]
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=2e-3)  # [09]
    flags.add_cifar10_arguments(parser, model="vit")  # [09]
    flags.add_dropout_argument(parser)  # [09]
    flags.add_amp_argument(parser)  # [02]
    flags.add_context_parallel_argument(parser)  # [10] --cp-size
    return parser.parse_args()


def main():
    args = parse_args()
    distributed.catch_stop_signals()  # [04] first: until then SIGTERM, SIGUSR1 kill the process
    context = setup(args)
    distributed.connect_stop_flag()  # [04] its own gloo group: fails here if gloo has no network
    train_set, sampler, train_loader, test_loader = build_data(context)
    model = build_model(context)
    # AdamW, as transformers train: each weight's step divided by the running size of its gradients.
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.05)  # [09]
    total_steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, total_steps=total_steps)
    last_step = min(args.max_steps, total_steps) if args.max_steps else total_steps
    state = utils.State(model, optimizer, scheduler, last_step)  # [09] bf16 or fp32: no scaler

    # Started again (torchrun --max-restarts, a requeued Slurm job)? The ranks decide together.
    if distributed.should_resume(args.resume, args.output_dir, "checkpoints", "latest"):  # [07]
        load_checkpoint(context, state)
        if utils.finished(args.output_dir, state.step, last_step):  # run again after its end
            return

    record = utils.RunRecord(__file__, context, len(train_loader))
    for epoch in range(state.epoch, args.epochs):  # from the checkpoint's epoch if resumed
        state.epoch = epoch
        sampler.set_epoch(epoch)  # a new order each epoch, or epoch 0's forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training(state.step)
        train_loss = train_one_epoch(context, state, train_loader)
        record.stop_training(state.step)
        test_loss, test_accuracy, test_samples = evaluate(context, model, test_loader)
        record.end_epoch(epoch, state.step, train_loss, test_loss, test_accuracy, test_samples)
        if state.step >= last_step:
            break

    metrics = record.metrics()  # wall_seconds ends here, before the final writes
    # A collective, on every rank: rank 0 alone receives the full weights, on its CPU, in fp32.
    options = dcp_state.StateDictOptions(full_state_dict=True, cpu_offload=True)  # [07]
    weights = dcp_state.get_model_state_dict(model, options=options)  # [07]
    if context.rank == 0:  # [04] one writer; no collective inside: no other rank would join it
        utils.write_outputs(args.output_dir, weights, metrics)  # [07]
    dist.barrier()  # [04] leave together: a rank that leaves while rank 0 writes can abort it
    dist.destroy_process_group()  # [04]


def setup(args):
    """What the run is, read by every function below (common/utils.py's Context)."""
    utils.seed_everything(args.seed)
    distributed.default_to_a_world_of_one()  # [04] started by plain `python`
    # torchrun sets each process's rank, local rank (its GPU), world size; Context reads the rank.
    local_rank, world_size = (int(os.environ[key]) for key in ("LOCAL_RANK", "WORLD_SIZE"))  # [04]
    # 09's precisions: fp16 would need 07's loss scaler back.
    if args.amp == "fp16":  # [09]
        raise utils.UsageError("--amp fp16: 10 trains without a loss scaler, as 09 does; "  # [10]
                               "use --amp bf16")  # [10]
    # Groups of C ranks share each image, each rank with 64 / C of its tokens (C divides them);
    # world size / C replicas of the group split the batch (common/distributed.py).
    cp_size, replicas = distributed.context_parallel_layout(args, world_size)  # [10]
    if not args.synthetic:
        data.download_cifar10(args.data_dir)
    device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")  # [04]
    if device.type == "cuda":  # [02]
        distributed.require_one_gpu_per_process()  # [04]
        torch.cuda.set_device(device)  # [04] before any CUDA work, or every process would use GPU 0
        # Strict: attention's fused kernels are deterministic only in that mode.
        utils.use_deterministic_kernels(strict=True)  # [09] or --resume drifts
    else:  # [02]
        distributed.print0("no GPU found: training on the CPU")  # [04]
    # The process group connects the processes for collectives (broadcast, all-reduce...): NCCL on
    # GPUs, gloo on CPUs. Joined last: a slow download, or one rank's failed check, would fail them.
    backend = "nccl" if device.type == "cuda" else "gloo"  # [04]
    dist.init_process_group(backend, timeout=distributed.TIMEOUT,  # [04]
                            device_id=device if backend == "nccl" else None)  # [04] NCCL: its GPU
    # rank = replica x cp_size + cp rank: a group's ranks are neighbours (on one machine where C
    # divides its GPUs), since every attention layer communicates within the group.
    mesh = init_device_mesh(device.type, (replicas, cp_size), mesh_dim_names=("dp", "cp"))  # [10]
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp], mesh=mesh)  # [09]


def build_data(context):
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
    # Per replica: the ranks of a context-parallel group must compute on the same images.
    replica, replicas = context.replica, context.replicas  # [04] a process, or a group of them
    batch_size = args.batch_size // replicas  # [04] this replica's share of each global batch
    train_set, test_set = data.load_cifar10(args.data_dir, args.synthetic, seed=args.seed)
    if args.batch_size > len(train_set):
        raise utils.UsageError(f"--batch-size {args.batch_size} is larger than the training set "
                               f"({len(train_set)})")
    # One order per seed and epoch; from 04 on, each replica keeps every replicas-th sample of it.
    sampler = DistributedSampler(train_set, num_replicas=replicas, rank=replica,  # [04]
                                 seed=args.seed, drop_last=True)  # [04]
    # Whole batches, cut and augmented on `device` in a few tensor ops (docs/data-and-model.md).
    train_loader = data.BatchLoader(train_set, batch_size, sampler=sampler, drop_last=True,  # [04]
                                    device=device, num_workers=args.num_workers)
    # A disjoint slice per replica: DistributedSampler would pad the slices, counting samples twice.
    # As many batches in each: from 05 on, a forward pass can be a collective that every rank joins.
    test_batches = data.equal_batches(len(test_set), replicas, replica, batch_size)  # [04]
    test_loader = data.BatchLoader(test_set, batch_sampler=test_batches, device=device,  # [04]
                                   num_workers=args.num_workers)
    return train_set, sampler, train_loader, test_loader


def build_model(context):
    """The model (common/models.py), on the run's device, as this step trains it. The optimizer
    is built after it: it must hold the shards (DTensors), not the full weights."""
    mesh = context.mesh  # [09]
    with torch.device("meta"):  # [07] shapes, no memory: each rank allocates its shards (to_empty)
        model = models.build(context.args)  # [07] so a model larger than one GPU fits
    # Context parallelism within each group: from the embedding on, each rank keeps 64 / C of
    # every image's tokens. The norms, the MLP and every projection work token by token: each rank
    # runs them on its own tokens.
    cp_rank, cp_size = mesh.get_local_rank("cp"), mesh["cp"].size()  # [10]

    def keep_own_tokens(module, inputs, tokens):  # [10] the embedding runs whole on every rank
        # A copy (a batch above 1): a view keeps all 64 tokens alive for the first norm's backward.
        return tokens.chunk(cp_size, dim=1)[cp_rank].contiguous()  # [10] (batch, 64 / C, width)

    # Attention is the one layer where tokens meet: each rank's queries need every token's key
    # and value, gathered from the group (a ring passes them in blocks instead: see
    # docs/context-parallel.md). Differentiable: the backward pass sums each token's gradients from
    # the group, on its own rank.
    def all_tokens(module, inputs, tokens):  # [10]
        return funcol.all_gather_single(tokens, 1, mesh["cp"])  # [10] dim 1: in token order

    model.embedding.register_forward_hook(keep_own_tokens)  # [10]
    for block in model.blocks:  # [10]
        block.attention.key.register_forward_hook(all_tokens)  # [10]
        block.attention.value.register_forward_hook(all_tokens)  # [10]
    # The head weighs every token's features, one after another: it gathers them too.
    model.head.register_forward_pre_hook(  # [10]
        lambda head, inputs: all_tokens(head, inputs, *inputs))  # [10]
    # Each block, then the root (the rest), becomes one FSDP unit, as in 07, over every rank (a 1D
    # mesh of the world): a group's ranks hold the same weights. Each of the C ranks computes the
    # group's loss, so their gradients add up to C times the replica's; FSDP2 divides the sum over
    # all ranks by C x replicas: the mean over the replicas. --amp: the gathered copies are cast to
    # 16 bits; the gradients are reduced, and the shards kept, in fp32.
    everyone = init_device_mesh(context.device.type, (context.world_size,))  # [10]
    amp_dtype = context.amp_dtype  # [07] --amp: the type of the gathered copies
    reduce_dtype = torch.float32 if amp_dtype else None  # [07] and fp32 shards, reduced gradients
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=reduce_dtype)  # [07]
    for block in model.blocks:  # [09]
        fully_shard(block, mesh=everyone, mp_policy=policy)  # [10]
    # The root returns the logits in fp32 under --amp (reduce_dtype): the loss is computed in fp32.
    root_policy = MixedPrecisionPolicy(amp_dtype, reduce_dtype, output_dtype=reduce_dtype)  # [07]
    fully_shard(model, mesh=everyone, mp_policy=root_policy)  # [10]
    model.to_empty(device=context.device)  # [07] this rank's shards, not yet initialised
    # The seed's weights, from rank 0's CPU one tensor at a time: each rank keeps only its shards.
    initial_weights = models.build(context.args).state_dict() if context.rank == 0 else {}  # [07]
    options = dcp_state.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # [07]
    dcp_state.set_model_state_dict(model, initial_weights, options=options)  # [07]
    return model


def train_one_epoch(context, state, loader):
    """Train until the end of the epoch or the run's last step; returns the mean loss."""
    args, device, model = context.args, context.device, state.model
    model.train()
    done = state.step - state.epoch * len(loader)  # batches of this epoch trained before a resume
    end = min(len(loader), done + state.last_step - state.step)
    loss_sum = torch.zeros((), device=device)
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {state.epoch + 1}", leave=False, disable=context.rank != 0)  # [04]
    for images, labels in progress:
        # Dropout masks from (seed, step, rank): each rank its own; a resume draws the same ones.
        torch.manual_seed(hash((args.seed, state.step, context.rank)))  # [09]
        # Every rank of the group computes the same logits, and the same loss.
        logits = model(images)  # [10] in fp32 under --amp, as in 07
        loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)  # [10]
        state.optimizer.zero_grad(set_to_none=True)  # [10]
        loss.backward()  # [10]
        state.optimizer.step()  # [10]
        state.scheduler.step()
        state.step += 1
        loss_sum += loss.detach()
        at_end = state.step == state.last_step
        stop = distributed.should_stop()  # [04] every rank, every step: none may stop alone
        save_due = stop or args.save_every and (state.step % args.save_every == 0 or at_end)  # [04]
        # Reading the loss waits for the step to finish: every 10 steps, at the end, before a save.
        if state.step % 10 == 0 or at_end or save_due:
            logged_loss = distributed.all_reduce_mean(loss).item()  # [04] all stop on a NaN at once
            utils.check_finite(logged_loss, state.step)  # a diverged run stops before it saves NaNs
            progress.set_postfix(loss=f"{logged_loss:.3f}")
        if save_due:
            save_checkpoint(context, state)
        if stop:  # [04] every rank stops after this step, saved: exit status 75
            raise utils.Preempted(state.step, args.output_dir)  # [04]
    return distributed.all_reduce_mean(loss_sum).item() / max(end - done, 1)  # [04]


@torch.no_grad()
def evaluate(context, model, loader):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    device = context.device
    model.eval()
    # The loss sum, the correct predictions, the samples.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        logits = models.predict(model, images, flip=context.args.tta)  # [10] no DTensor
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    # Over the replicas: a group's ranks hold the same totals.
    dist.all_reduce(totals, group=context.mesh["dp"].get_group())  # [09]
    loss_sum, correct, samples = totals.tolist()
    return loss_sum / samples, correct / samples, int(samples)


def save_checkpoint(context, state):
    """Everything a resumed run needs to continue as if it had never stopped."""
    args, directory = context.args, os.path.join(context.args.output_dir, "checkpoints")  # [07]
    path = os.path.join(directory, f"step{state.step}")  # [07]
    # A tensor not sharded is written once, from any rank: make the buffers rank 0's everywhere.
    distributed.broadcast_buffers(state.model)  # [07]
    # The weights and the optimizer state stay sharded: every rank writes its own, in parallel.
    model_state, optimizer_state = dcp_state.get_state_dict(state.model, state.optimizer)  # [07]
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # [07]
    if context.rank != 0:  # [04] what follows is the same on every rank: one writer
        return  # [04]
    utils.save_atomic({
        "scheduler": state.scheduler.state_dict(),
        "epoch": state.epoch,
        "step": state.step,
        "rng": utils.get_rng_state(),
        **utils.resume_settings(args),  # load_checkpoint refuses a resume with others
    }, os.path.join(path, "train_state.pt"))  # [07]
    utils.commit_checkpoint(directory, f"step{state.step}")  # [07] `latest` names it, last


def load_checkpoint(context, state):
    """Restore `save_checkpoint`'s state into `state`, and say where the run continues."""
    args = context.args  # [07]
    path = utils.latest_checkpoint(os.path.join(args.output_dir, "checkpoints"))  # [07]
    checkpoint = utils.load_checkpoint(os.path.join(path, "train_state.pt"), "cpu")  # [07]
    utils.check_resumable(path, checkpoint, **utils.resume_settings(args))
    # Every rank reads the parts of the shards it now holds: a checkpoint loads at any world size.
    model_state, optimizer_state = dcp_state.get_state_dict(state.model, state.optimizer)  # [07]
    dcp.load({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)  # [07]
    dcp_state.set_state_dict(state.model, state.optimizer,  # [07]
                             model_state_dict=model_state, optim_state_dict=optimizer_state)  # [07]
    state.scheduler.load_state_dict(checkpoint["scheduler"])
    utils.set_rng_state(checkpoint["rng"])
    state.step, state.epoch = checkpoint["step"], checkpoint["epoch"]
    utils.report_resume(path, checkpoint)


if __name__ == "__main__":
    utils.run(main)
