#!/usr/bin/env bash
# One H200 call (session 3, 2026-12-03): the new features' first GPU numbers, each bounded.
# Logs and JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 75 python bench/ssd_layer.py --hidden 2048 --seqs 4096,16384 --iters 3 --warmup 1 \
    --out "$O/ssd_layer.json" 2>&1 | tee "$O/ssd.log" | tail -14
timeout 80 python bench/vlm_throughput.py --steps 4 --warmup 2 --out "$O/vlm_throughput.json" \
    2>&1 | tee "$O/vlm.log" | tail -8
timeout 150 python bench/plan_accuracy.py --warmup 2 --steps 3 --override model.compile=false \
    --out "$O/plan_accuracy-h200.json" 2>&1 | tee "$O/plan.log" | tail -9
timeout 110 python bench/serve_throughput.py --num-prompts 256 --graphs on \
    --out "$O/serve_throughput.json" 2>&1 | tee "$O/serve.log" | tail -24
timeout 150 python -m trireme train --config llama3-1b --data.mock=true --train.steps=40 \
    --train.log_interval=10 --train.eval_interval=0 --train.sample_tokens=0 \
    --logging.progress=false --logging.tensorboard=false --run.dir=/tmp/l1b 2>&1 \
    | tee "$O/train_default.log" | tail -7
cp /tmp/l1b/metrics.jsonl "$O/llama3-1b-default-metrics.jsonl" 2>/dev/null || true
