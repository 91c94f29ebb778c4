#!/usr/bin/env bash
# The MoE numbers of issue 15 on one H200, in one device call (bench/RESULTS.md records them):
# the MoE sublayer against a dense MLP, and a Qwen3-30B-A3B-shaped model cut to 6 layers trained
# by `trireme train` itself (eager and compiled), then its step profile. Results under $OUT.
set -uo pipefail
OUT=${OUT:-bench/results}
export TRIREME_COMMIT=${TRIREME_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
CUT=(--model.num_layers=6 --model.layer_pattern='*E*E*E*E*E*E')
TRAIN=(--data.mock=true --train.global_batch_size=32 --train.micro_batch_size=4
       --train.steps=12 --train.log_interval=4 --train.eval_interval=0 --train.sample_tokens=0
       --logging.progress=false --logging.tensorboard=false)
nvidia-smi --query-gpu=name,power.limit,memory.total --format=csv,noheader
timeout 150 python bench/moe_layer.py --iters 10 --out "$OUT/moe_layer.json"
for variant in eager compile; do
    extra=(); [ "$variant" = compile ] && extra=(--model.compile=true)
    timeout 200 python -m trireme train --config qwen3-30b-a3b "${CUT[@]}" "${TRAIN[@]}" \
        --run.dir="$OUT/qwen3-cut-$variant" "${extra[@]}" 2>&1 | tail -8
done
timeout 150 python bench/profile_step.py --preset qwen3-30b-a3b --micro-batch-size 4 \
    --global-batch-size 32 --steps 2 --warmup 2 --tag cut6 --top 20 \
    --override model.num_layers=6 'model.layer_pattern=*E*E*E*E*E*E' 2>&1 | tail -45
cp bench/results/profile-qwen3-30b-a3b-cut6.json "$OUT/" 2>/dev/null || true
