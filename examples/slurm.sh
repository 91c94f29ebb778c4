#!/bin/bash
# Multi-node training under SLURM: one torchrun per node, 8 GPUs each, rendezvous on the first node.
#
#   sbatch examples/slurm.sh                      # 2 nodes x 8 GPUs: TP 8 inside a node, DP 2 across
#   sbatch --nodes 4 examples/slurm.sh --parallel.tensor=4 --parallel.distributed_optimizer=true
#
# Extra arguments go to `trireme train`. The data must be readable at the same path on every node.
#
# Fault tolerance: if a rank dies, torchrun restarts every rank (up to MAX_RESTARTS times) and they
# resume from the latest checkpoint in CHECKPOINT_DIR (a path every node sees), with the same
# consumed samples. With MIN_NODES < the allocation, the job goes on after losing nodes, at a
# smaller data-parallel degree (same global batch, same losses). A rank that freezes is named
# after TIMEOUT_MINUTES (docs/parallelism.md, "When a rank fails").
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
MIN_NODES=${MIN_NODES:-$SLURM_NNODES}
MAX_RESTARTS=${MAX_RESTARTS:-3}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$PWD/checkpoints/$SLURM_JOB_NAME}
TIMEOUT_MINUTES=${TIMEOUT_MINUTES:-10}

export OMP_NUM_THREADS=8
# export NCCL_SOCKET_IFNAME=ib0     # uncomment if NCCL picks the wrong network interface
# export NCCL_DEBUG=WARN

# --kill-on-bad-exit=0 with MIN_NODES < nodes: the other nodes' torchruns go on without a lost one
srun --kill-on-bad-exit=$([ "$MIN_NODES" = "$SLURM_NNODES" ] && echo 1 || echo 0) torchrun \
    --nnodes "$MIN_NODES:$SLURM_NNODES" \
    --max-restarts "$MAX_RESTARTS" \
    --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" \
    --rdzv-backend c10d \
    --rdzv-endpoint "$HEAD_NODE:$RDZV_PORT" \
    -m trireme train --config "$CONFIG" \
    --parallel.tensor="$GPUS_PER_NODE" \
    --parallel.timeout_minutes="$TIMEOUT_MINUTES" \
    --checkpoint.dir="$CHECKPOINT_DIR" --checkpoint.interval=500 --checkpoint.async_save=true \
    "$@"
