"""The command-line contract that every step shares (see the README's "Command-line contract")."""

import argparse
import os

import torch

from common import models
from common.utils import UsageError


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        # argparse would print the usage and exit from every rank; one line from rank 0 is enough.
        raise UsageError(message)


def _positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text):
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def _positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def build_parser(script_file, description, *, epochs, batch_size, lr):
    """A parser holding the shared flags; a step may add its own before parsing."""
    script = os.path.splitext(os.path.basename(script_file))[0]
    parser = _Parser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-dir", default="./data", help="where the data set lives or is downloaded to")
    parser.add_argument("--synthetic", action="store_true", help="use generated stand-in data (offline)")
    parser.add_argument("--epochs", type=_positive_int, default=epochs, help="passes over the training set")
    parser.add_argument("--max-steps", type=_non_negative_int, default=0,
                        help="stop after this many optimizer steps in total (0: no limit)")
    parser.add_argument("--batch-size", type=_positive_int, default=batch_size,
                        help="GLOBAL batch size: samples per optimizer step, all processes together")
    parser.add_argument("--lr", type=_positive_float, default=lr, help="peak learning rate")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights, data order and augmentation")
    parser.add_argument("--num-workers", type=_non_negative_int, default=2, help="data-loader worker processes")
    parser.add_argument("--amp", choices=["none", "fp16", "bf16"], default="none", help="mixed precision")
    parser.add_argument("--output-dir", default=os.path.join("runs", script), help="where outputs go")
    parser.add_argument("--save-every", type=_non_negative_int, default=0,
                        help="write a resumable checkpoint every N optimizer steps (and at the end)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the checkpoint in --output-dir")
    return parser


# --amp's choices as autocast dtypes; None means plain fp32.
AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def accept_local_rank_argument(parser):
    """Accept the local rank that older launchers pass as an argument (torch.distributed.launch:
    --local-rank, the deepspeed launcher: --local_rank); the scripts read LOCAL_RANK instead, which
    every launcher sets."""
    parser.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)


def add_norm_argument(parser):
    """ResNet-9's normalisation layers (the CIFAR-10 steps)."""
    parser.add_argument("--norm", choices=models.NORMS, default="batch",
                        help="batch: BatchNorm (faster to train); group: GroupNorm, whose result does not depend "
                             "on how the batch is split across processes (see the README's Parity section)")
