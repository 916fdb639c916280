"""Step 11: a mixture of experts, the experts split across ranks: expert parallelism and FSDP2.

New (relative to step 09; lines marked `# [11]`): each block's MLP becomes a mixture of `--experts`
MLPs, of which a router picks `--top-k` for each token, with a load-balancing loss. A group of
`--ep-size` ranks holds the experts, experts / ep-size each. Every rank trains on its own images, as
in 07; in each block, each token travels to the ranks of its chosen experts and back (two
all-to-alls, their sizes uneven: whatever the router chose), and no token is dropped. The rest of
the model, and the copies of each expert that world size / `--ep-size` groups hold, are sharded
with FSDP2. The run reports how many tokens each expert received. No GPU: gloo on the CPU.

Launch:
    torchrun --nproc_per_node=N 11_cifar10_expert_parallel.py --ep-size 2 --amp bf16  # N GPUs
    torchrun --standalone --nproc_per_node=2 11_cifar10_expert_parallel.py --synthetic  # CPU
    torchrun --standalone --nproc_per_node=4 11_cifar10_expert_parallel.py --synthetic  # ep 2 x2
"""

import logging  # [09]
import os

import torch
import torch.distributed as dist  # [04]
import torch.distributed._functional_collectives as funcol  # [11] collectives that autograd follows
import torch.distributed.checkpoint as dcp  # [07]
import torch.distributed.checkpoint.state_dict as dcp_state  # [07] the sharded state, in and out
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh  # [09]
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # [07]
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor  # [11]
from torch.utils.data import DistributedSampler
from tqdm import tqdm

from common import data, distributed, flags, models, utils  # [04]


def parse_args():
    parser = flags.build_parser(__file__, __doc__, epochs=10, batch_size=256, lr=2e-3)  # [09]
    flags.add_cifar10_arguments(parser, model="vit")  # [09]
    flags.add_dropout_argument(parser)  # [09]
    flags.add_amp_argument(parser)  # [02]
    flags.add_expert_parallel_arguments(parser)  # [11] --experts, --top-k, --ep-size
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

    record = utils.RunRecord(__file__, context, len(train_loader), top_k=args.top_k)  # [11]
    for epoch in range(state.epoch, args.epochs):  # from the checkpoint's epoch if resumed
        state.epoch = epoch
        sampler.set_epoch(epoch)  # a new order each epoch, or epoch 0's forever
        train_set.set_epoch(epoch)  # augmentation draws depend on (seed, epoch, sample) only
        record.start_training(state.step)
        train_loss, routed = train_one_epoch(context, state, train_loader)  # [11]
        record.stop_training(state.step)
        test_loss, test_accuracy, test_samples = evaluate(context, model, test_loader)
        record.end_epoch(epoch, state.step, train_loss, test_loss, test_accuracy,  # [11]
                         test_samples, more=f"tokens per expert {routed.sum(0).tolist()}")  # [11]
        if state.step >= last_step:
            break

    metrics = record.metrics()  # wall_seconds ends here, before the final writes
    metrics["tokens_per_expert"] = routed.tolist()  # [11] the last epoch's (since a resume)
    # A collective, on every rank: rank 0 alone receives the full weights, on its CPU, in fp32.
    # A weight split along both mesh dimensions is gathered in two steps: torch warns on every rank.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)  # [09]
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
    # A step skipped for an overflow must be skipped by every rank of a group.
    if args.amp == "fp16":  # [09]
        raise utils.UsageError("--amp fp16: 11 trains without a loss scaler, as 09 and "  # [11]
                               "10 do; use --amp bf16")  # [11]
    ep_size, copies = distributed.expert_parallel_layout(args, world_size)  # [11]
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
    # Groups of P ranks hold the experts, E / P each; world size / P groups hold a copy each. rank =
    # copy x P + ep rank: a group's ranks are neighbours (one machine's, where P divides its GPUs),
    # as every block's all-to-alls run in the group. "edp" (Megatron's name): the experts' copies.
    mesh = init_device_mesh(device.type, (copies, ep_size), mesh_dim_names=("edp", "ep"))  # [11]
    return utils.Context(args, device, amp_dtype=flags.AMP_DTYPES[args.amp], mesh=mesh)  # [09]


def build_data(context):
    """The training set, its sampler, and the training and test loaders."""
    args, device = context.args, context.device
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
    # Each rank of a group holds E / P of every block's experts: a slice of the stacked weights.
    def hold_own_experts(name, experts, ep):  # [11]
        for key, w in experts.named_parameters(recurse=False):  # [11] up, down
            setattr(experts, key, torch.nn.Parameter(distribute_tensor(w, ep, [Shard(0)])))  # [11]
    # Before the experts, each token goes to its experts' ranks: to each, as many as it chose.
    def send_to_experts(experts, inputs, ep):  # [11]
        tokens, counts = inputs  # [11] sorted by expert; counts: how many for each of the E experts
        received = funcol.all_to_all_single(counts, None, None, ep)  # [11] per rank and expert
        # On a GPU, the block's one wait: both tables to the CPU at once, (rank, expert) each.
        sent, received = torch.stack([counts, received]).view(2, ep.size(), -1).cpu()  # [11]
        experts.splits = sent.sum(1).tolist(), received.sum(1).tolist()  # [11] to, from each rank
        tokens = funcol.all_to_all_single_autograd(tokens, *experts.splits[::-1], ep)  # [11]
        return tokens, received  # [11] by source rank, then by expert: models.Experts reads both
    # After, each output back to its token's rank. Differentiable: gradients go the other way.
    def send_back(experts, outputs, ep):  # [11]
        return funcol.all_to_all_single_autograd(outputs, *experts.splits, ep)  # [11]
    for block in model.blocks:  # [11]
        distribute_module(block.mlp.experts, mesh["ep"], hold_own_experts,  # [11]
                          send_to_experts, send_back)  # [11]
    # FSDP2 as in 07: each rank's experts over their copies ("edp"), the rest over every rank (a 1D
    # mesh of the world). --amp: gathered copies in 16 bits; gradients reduced, and kept, in fp32.
    everyone = init_device_mesh(context.device.type, (context.world_size,))  # [11]
    amp_dtype = context.amp_dtype  # [07] --amp: the type of the gathered copies
    reduce_dtype = torch.float32 if amp_dtype else None  # [07] and fp32 shards, reduced gradients
    policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=reduce_dtype)  # [07]
    for block in model.blocks:  # [09]
        fully_shard(block.mlp.experts, mesh=mesh["edp"], mp_policy=policy)  # [11]
        # An expert's gradients add up its group's P losses: the mean over its copies, divided by
        # P, is the world's (FSDP2's set_gradient_divide_factor fails on gloo: expert-parallel.md).
        block.mlp.experts.set_all_reduce_hook(lambda grad: grad.div_(mesh["ep"].size()))  # [11]
        fully_shard(block, mesh=everyone, mp_policy=policy)  # [11]
    # The root returns the logits in fp32 under --amp (reduce_dtype): the loss is computed in fp32.
    root_policy = MixedPrecisionPolicy(amp_dtype, reduce_dtype, output_dtype=reduce_dtype)  # [07]
    fully_shard(model, mesh=everyone, mp_policy=root_policy)  # [11]
    model.to_empty(device=context.device)  # [07] this rank's shards, not yet initialised
    # The seed's weights, from rank 0's CPU one tensor at a time: each rank keeps only its shards.
    initial_weights = models.build(context.args).state_dict() if context.rank == 0 else {}  # [07]
    options = dcp_state.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)  # [07]
    dcp_state.set_model_state_dict(model, initial_weights, options=options)  # [07]
    return model


def train_one_epoch(context, state, loader):
    """Train to the epoch's end or the run's last step; returns the mean loss, tokens per expert."""
    args, device, model = context.args, context.device, state.model
    model.train()
    done = state.step - state.epoch * len(loader)  # batches of this epoch trained before a resume
    end = min(len(loader), done + state.last_step - state.step)
    loss_sum = torch.zeros((), device=device)
    routed = torch.zeros(len(model.blocks), args.experts, dtype=torch.long, device=device)  # [11]
    progress = tqdm(loader.batches(done, end), total=end - done,
                    desc=f"epoch {state.epoch + 1}", leave=False, disable=context.rank != 0)  # [04]
    for images, labels in progress:
        # Dropout masks from (seed, step, rank): each rank its own; a resume draws the same ones.
        torch.manual_seed(hash((args.seed, state.step, context.rank)))  # [09]
        logits = model(images)  # [11] in fp32 under --amp, as in 07
        loss = F.cross_entropy(logits, labels, label_smoothing=args.label_smoothing)  # [11]
        # Load balancing over the whole batch: each rank's probabilities, every rank's assignments.
        counts = torch.stack([block.mlp.tokens_per_expert for block in model.blocks])  # [11]
        dist.all_reduce(counts)  # [11] (blocks, experts)
        balance = sum(map(lambda block, n: block.mlp.balance_loss(n), model.blocks, counts))  # [11]
        state.optimizer.zero_grad(set_to_none=True)  # [11]
        (loss + args.balance_weight * balance).backward()  # [11]
        state.optimizer.step()  # [11]
        state.scheduler.step()
        state.step += 1
        loss_sum += loss.detach()
        routed += counts  # [11]
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
    return distributed.all_reduce_mean(loss_sum).item() / max(end - done, 1), routed  # [11]


@torch.no_grad()
def evaluate(context, model, loader):
    """Mean loss and accuracy over the whole test set; returns them and the number of samples."""
    device = context.device
    model.eval()
    # The loss sum, the correct predictions, the samples.
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for images, labels in loader:
        logits = models.predict(model, images, flip=context.args.tta)  # [11] no DTensor
        totals[0] += F.cross_entropy(logits.float(), labels, reduction="sum")
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals)  # [11] sums over ranks: each holds the totals of its own slice
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
