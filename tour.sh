#!/usr/bin/env bash
# The whole tour on the built-in synthetic data: every step, launched as its docstring says, on
# whatever this machine has (a CPU is enough: multi-process steps then use gloo). Outputs go to runs/.
set -euo pipefail
cd "$(dirname "$0")"
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"  # DeepSpeed also needs the environment's ninja
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo}  # one machine: keep gloo on the loopback interface
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
procs=$((gpus > 0 ? gpus : 2))  # one process per GPU; without GPUs, 2 CPU processes
# The deepspeed launcher, unlike torchrun, leaves every process all the cores: share them out.
threads=${OMP_NUM_THREADS:-$(( $(nproc) / procs > 0 ? $(nproc) / procs : 1 ))}
# Every step at its own defaults (its learning rate scaled to this batch), for 2 short epochs.
args=(--synthetic --epochs 2 --batch-size 64)

python 01_cifar10_cpu.py "${args[@]}"
python 02_cifar10_gpu.py "${args[@]}"
python 03_cifar10_dataparallel.py "${args[@]}"
torchrun --standalone --nproc_per_node=$procs 04_cifar10_ddp.py "${args[@]}"
OMP_NUM_THREADS=$threads deepspeed --num_gpus=$procs 05_cifar10_deepspeed.py "${args[@]}"
torchrun --standalone --nproc_per_node=$procs 06_mnist_accelerate.py "${args[@]}"
torchrun --standalone --nproc_per_node=$procs 07_cifar10_fsdp.py "${args[@]}"
# 2 pipeline stages (x replicas for the other processes); a single or an odd number of processes: 1 stage.
torchrun --standalone --nproc_per_node=$procs 08_cifar10_pipeline.py "${args[@]}" --stages $((procs % 2 ? 1 : 2))
# Tensor-parallel groups of 2 (x replicas for the other processes); a single or an odd number of processes: 1.
torchrun --standalone --nproc_per_node=$procs 09_cifar10_tensor_parallel.py "${args[@]}" --tp-size $((procs % 2 ? 1 : 2))
# Context-parallel groups of 2, likewise.
torchrun --standalone --nproc_per_node=$procs 10_cifar10_context_parallel.py "${args[@]}" --cp-size $((procs % 2 ? 1 : 2))
# Expert-parallel groups of 2, likewise.
torchrun --standalone --nproc_per_node=$procs 11_cifar10_expert_parallel.py "${args[@]}" --ep-size $((procs % 2 ? 1 : 2))
python benchmarks/report.py runs/[01]*/ --output runs/tour.png --title "bash tour.sh, $([ "$gpus" -gt 0 ] && echo "$gpus GPUs" || echo "CPU only")"
echo "tour finished: outputs in runs/, the picture in runs/tour.png"
