#!/usr/bin/env bash
# Issue 19 goal 3 on one H200: fp8 delayed scaling (model.fp8_scaling) and the fp8 output layer
# (model.fp8_layers "output") against bf16 and today's fp8. Calls of < 10 min each:
#   bash bench/gpu_fp8_delayed.sh throughput-a  # llama3-1b, mb 16 x 4096: fp8, delayed + output
#   bash bench/gpu_fp8_delayed.sh throughput-b  # the same: delayed alone, output alone
#   bash bench/gpu_fp8_delayed.sh parity        # 300 steps on real text, seq 1024 (3 variants)
#   bash bench/gpu_fp8_delayed.sh profile       # the delayed + output step, by kernel category
# Logs and JSON under $OUT (else bench/results). Goal: step <= 0.784 s (1.3x bf16's 1.019 s),
# final loss within 1% of bf16.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-bench/results}
ALL='model.fp8_layers=["qkv","out","fc1","fc2","output"]'
# the recipe before the "auto" defaults: current scaling on BLOCKS (the defaults are now ALL, delayed)
BLOCKS='model.fp8_layers=["qkv","out","fc1","fc2"]'
tp() {  # name, overrides...: one throughput run (warmup 3: step 1 current, then delayed)
    local name=$1; shift
    timeout 280 python bench/train_throughput.py --preset llama3-1b --warmup 3 --steps 8 \
        --compile --fused-cross-entropy --micro-batch-size 16 --override "$@" \
        --out "$O/train_throughput-llama3-1b-fce-$name-mb16.json" 2>&1 \
        | tee "$O/tp-$name.log" | tail -4
}
case ${1:-throughput-a} in
throughput-a)
    nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
    tp fp8 model.precision=fp8 model.fp8_scaling=current "$BLOCKS"
    tp fp8-delayed-out model.precision=fp8 model.fp8_scaling=delayed "$ALL"
    ;;
throughput-b)
    tp fp8-delayed model.precision=fp8 model.fp8_scaling=delayed "$BLOCKS"
    tp fp8-out model.precision=fp8 model.fp8_scaling=current "$ALL"
    ;;
parity)
    timeout 580 python bench/loss_parity.py --preset llama3-1b --steps 300 \
        --tag llama3-1b-seq1024-fp8-delayed \
        --override model.seq_length=1024 train.global_batch_size=8 model.compile=true \
        model.fused_cross_entropy=true \
        --variant bf16:model.precision=bf16 \
        --variant "fp8:model.precision=fp8,model.fp8_scaling=current,$BLOCKS" \
        --variant "fp8-delayed-out:model.precision=fp8,model.fp8_scaling=delayed,$ALL" \
        2>&1 | tee "$O/loss_parity-fp8-delayed.log" | tail -12
    ;;
profile)  # where the delayed + output step's time goes (compare profile-...-fp8-mb16.json)
    timeout 500 python bench/profile_step.py --preset llama3-1b --compile --micro-batch-size 16 \
        --steps 2 --warmup 3 --tag llama3-1b-compile-fp8-delayed-out-mb16 \
        --override model.fused_cross_entropy=true model.precision=fp8 \
        model.fp8_scaling=delayed "$ALL" 2>&1 | tee "$O/profile-fp8-delayed-out.log" | tail -40
    ;;
esac
