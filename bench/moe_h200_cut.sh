#!/usr/bin/env bash
# The Qwen3-30B-A3B shape cut to 6 layers, compiled, at micro batch 4 and 8 (global batch 32 x
# 4096), trained by `trireme train`, then the compiled step's profile. Results under $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
CUT=(--model.num_layers=6 --model.layer_pattern='*E*E*E*E*E*E')
TRAIN=(--data.mock=true --train.global_batch_size=32 --train.steps=12 --train.log_interval=4
       --train.eval_interval=0 --train.sample_tokens=0 --logging.progress=false
       --logging.tensorboard=false --model.compile=true)
for mb in 4 8; do
    timeout 200 python -m trireme train --config qwen3-30b-a3b "${CUT[@]}" "${TRAIN[@]}" \
        --train.micro_batch_size=$mb --run.dir="$OUT/qwen3-cut-compile-mb$mb" 2>&1 | tail -4
done
timeout 170 python bench/profile_step.py --preset qwen3-30b-a3b --micro-batch-size 8 \
    --global-batch-size 32 --steps 2 --warmup 2 --compile --tag cut6-compile-mb8 --top 12 \
    --override model.num_layers=6 'model.layer_pattern=*E*E*E*E*E*E' 2>&1 | tail -32
cp bench/results/profile-qwen3-30b-a3b-cut6-compile-mb8.json "$OUT/" 2>/dev/null || true
