#!/bin/bash
# Multi-node training under SLURM: one torchrun per node, 8 GPUs each, rendezvous on the first node.
#
#   sbatch examples/slurm.sh                      # 2 nodes x 8 GPUs: TP 8 inside a node, DP 2 across
#   sbatch --nodes 4 examples/slurm.sh --parallel.tensor=4 --parallel.distributed_optimizer=true
#
# Extra arguments go to `trireme train`. The data must be readable at the same path on every node.
#SBATCH --job-name=trireme
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # one torchrun per node; it starts the 8 ranks itself
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=96
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --output=%x-%j.out

set -euo pipefail

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
CONFIG=${CONFIG:-llama3-8b}
# The first node of the allocation hosts the rendezvous; any free port works.
HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
RDZV_PORT=${RDZV_PORT:-29500}

export OMP_NUM_THREADS=8
# export NCCL_SOCKET_IFNAME=ib0     # uncomment if NCCL picks the wrong network interface
# export NCCL_DEBUG=WARN

srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" \
    -m trireme train --config "$CONFIG" \
    --parallel.tensor="$GPUS_PER_NODE" \
    "$@"
