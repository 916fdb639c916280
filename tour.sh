#!/usr/bin/env bash
# The whole tour on the built-in synthetic data: every step, launched as its docstring says, on
# whatever this machine has (a CPU is enough: multi-process steps then use gloo). Outputs go to runs/.
set -euo pipefail
cd "$(dirname "$0")"
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}  # one machine: keep gloo on the loopback interface
args=(--synthetic --epochs 2 --batch-size 64 --lr 0.1)

python 01_cifar10_cpu.py "${args[@]}"
python 02_cifar10_gpu.py "${args[@]}"
python 03_cifar10_dataparallel.py "${args[@]}"
torchrun --standalone --nproc_per_node=2 04_cifar10_ddp.py "${args[@]}"
# AdamW, so not the SGD learning rate above; a CPU machine runs the same command (gloo).
torchrun --standalone --nproc_per_node=2 06_mnist_accelerate.py --synthetic --epochs 2 --batch-size 64
echo "tour finished: outputs in runs/"
