"""The command-line contract that every step shares (the README's "The command-line contract")."""

import argparse
import math
import os

import torch

from common import models
from common.utils import UsageError

# --amp's choices as autocast dtypes; None means plain fp32.
AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


# The learning rate of every step's default follows the global batch (the linear scaling rule): the
# default --lr is the reference rate at this many samples per step, times --batch-size / this.
REFERENCE_BATCH_SIZE = 256


class _Parser(argparse.ArgumentParser):
    reference_lr = None  # the default --lr at REFERENCE_BATCH_SIZE
    fp16_cpu_refusal = None  # why this step refuses --amp fp16 without a GPU (None: it accepts it)

    def error(self, message):
        # argparse would print the usage and exit from every rank; one line from one process is enough.
        raise UsageError(message)

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if parsed.lr is None:
            parsed.lr = self.reference_lr * parsed.batch_size / REFERENCE_BATCH_SIZE
        if getattr(parsed, "amp", None) == "fp16" and not torch.cuda.is_available() and self.fp16_cpu_refusal:
            hint = " (accelerate launch: --mixed_precision no)" if "ACCELERATE_MIXED_PRECISION" in os.environ else ""
            raise UsageError(f"--amp fp16 needs a GPU here: {self.fp16_cpu_refusal}; on the CPU use --amp bf16 "
                             f"or --amp none{hint}")
        return parsed


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _non_negative_float(text):
    value = float(text)
    if not 0 <= value < math.inf:  # NaN too
        raise argparse.ArgumentTypeError(f"must be a finite number, 0 or more, got {text}")
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _unit_fraction(text):
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 0 and less than 1, got {text}")
    return value


def build_parser(script_file, description, *, epochs, batch_size, lr):
    """A parser holding the flags that every step has; a step adds its own before parsing. `lr` is the
    default learning rate at a global batch of REFERENCE_BATCH_SIZE: the default scales with --batch-size."""
    script = os.path.splitext(os.path.basename(script_file))[0]
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.reference_lr = lr
    parser.add_argument("--data-dir", default="./data", help="where the data set lives or is downloaded to")
    parser.add_argument("--synthetic", action="store_true", help="use generated stand-in data (offline)")
    parser.add_argument("--epochs", type=positive_int, default=epochs, help="passes over the training set")
    parser.add_argument("--max-steps", type=_non_negative_int, default=0,
                        help="stop after this many optimizer steps in total (0: no limit)")
    parser.add_argument("--batch-size", type=positive_int, default=batch_size,
                        help="GLOBAL batch size: samples per optimizer step, all processes together")
    parser.add_argument("--lr", type=_positive_float,
                        help=f"peak learning rate (default: {lr} x --batch-size / {REFERENCE_BATCH_SIZE})")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights, data order and augmentation")
    parser.add_argument("--num-workers", type=_non_negative_int, default=2, help="data-loader worker processes")
    parser.add_argument("--output-dir", default=os.path.join("runs", script), help="where outputs go")
    parser.add_argument("--save-every", type=_non_negative_int, default=0,
                        help="write a resumable checkpoint every N optimizer steps (and at the end)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --output-dir")
    # Older launchers pass the local rank as an argument (torch.distributed.launch: --local-rank=N, the
    # deepspeed launcher: --local_rank=N). Accepted and ignored: the steps read LOCAL_RANK, which every
    # launcher sets.
    parser.add_argument("--local-rank", "--local_rank", type=int, help=argparse.SUPPRESS)
    return parser


def add_amp_argument(parser, default="none", fp16_cpu_refusal=None):
    """--amp, for the steps that train in mixed precision (02 onwards). fp16 runs on a CPU too (slowly: most
    CPUs have no fp16 arithmetic), with torch's loss scaling; a step whose library has no fp16 on the CPU
    says why in `fp16_cpu_refusal`."""
    parser.fp16_cpu_refusal = fp16_cpu_refusal
    parser.add_argument("--amp", choices=list(AMP_DTYPES), default=default,
                        help="mixed precision: fp16 (with loss scaling) or bf16")


def accelerate_launch_amp():
    """The mixed precision that `accelerate launch` passes in the environment, as an --amp value."""
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    return "none" if precision == "no" else precision


def add_norm_argument(parser):
    """ResNet-9's normalisation layers (the CIFAR-10 steps)."""
    parser.add_argument("--norm", choices=models.NORMS, default="batch",
                        help="batch: BatchNorm (faster to train); group: GroupNorm, whose result does not depend "
                             "on how the batch is split across processes (docs/parity.md)")


def add_cifar10_arguments(parser, model="resnet9"):
    """The CIFAR-10 steps' model and recipe flags (docs/data-and-model.md), for ResNet-9 or for the vision
    transformer ("vit"): `models.build(args)` builds it. The defaults keep the CPU tour quick."""
    parser.set_defaults(model=model)
    if model == "resnet9":
        add_norm_argument(parser)
        parser.add_argument("--width", type=positive_int, default=32,
                            help="ResNet-9's channels in its first stage: 32 (half the original), 64 (the original)")
    else:
        parser.add_argument("--width", type=positive_int, default=128,
                            help="the transformer's features per token (a multiple of its 4 attention heads)")
    parser.add_argument("--label-smoothing", type=_unit_fraction, default=0.0,
                        help="the weight of the uniform distribution mixed into each training target")
    parser.add_argument("--tta", action="store_true",
                        help="test-time augmentation: evaluate on each image and its mirror image")


def add_dropout_argument(parser):
    """--no-dropout: the counterpart of --norm group for the models with dropout (steps 06, 09-11)."""
    parser.add_argument("--no-dropout", action="store_true",
                        help="train without dropout, so that the result does not depend on the number of processes "
                             "(docs/parity.md)")


def add_deepspeed_arguments(parser):
    """Step 05's own flags. The command line wins where it and the DeepSpeed config both speak."""
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], help="default: the config's")
    parser.add_argument("--gradient_accumulation_steps", "--gradient-accumulation-steps", metavar="N",
                        type=positive_int, help="micro-batches per optimizer step (default: the config)")
    repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser.add_argument("--deepspeed-config", default=os.path.join(repository, "ds_config.json"),
                        help="DeepSpeed's settings (default: the repository's ds_config.json)")


def add_pipeline_arguments(parser, schedules):
    """Step 08's own flags: the pipeline's stages, micro-batches and schedule."""
    parser.add_argument("--stages", type=positive_int,
                        help="pipeline stages (default: the most that divide the world size, up to 5 and to "
                             "--microbatches)")
    parser.add_argument("--microbatches", type=positive_int, default=4, help="per replica's batch")
    parser.add_argument("--schedule", choices=schedules, default="1f1b", help="GPipe or 1F1B")


def add_tensor_parallel_argument(parser):
    """Step 09's own flag: the tensor-parallel group's size."""
    parser.add_argument("--tp-size", type=positive_int, help="ranks per layer (default: 2, or 1 alone)")


def add_expert_parallel_arguments(parser):
    """Step 11's own flags: the mixture of experts and the expert-parallel group's size."""
    parser.add_argument("--experts", type=positive_int, default=8, help="experts in each block's mixture")
    parser.add_argument("--top-k", type=positive_int, default=2, help="experts that each token is routed to")
    parser.add_argument("--ep-size", type=positive_int, help="ranks that share the experts, each with experts / "
                        "ep-size of them (default: 2, or 1 alone)")
    parser.add_argument("--balance-weight", type=_non_negative_float, default=0.01,  # a negative one rewards imbalance
                        help="the weight of the load-balancing loss (the Switch Transformer's 0.01)")


def add_context_parallel_argument(parser):
    """Step 10's own flag: the context-parallel group's size."""
    parser.add_argument("--cp-size", type=positive_int, help="ranks per image, each with a share of its tokens "
                        "(default: 2, or 1 alone)")
