#!/usr/bin/env bash
# One H200 call (session 4, 2026-12-03, about 8 minutes): the serving decode step with the fixed
# compiled forward and the host overlap; fp8 with delayed scaling and the fp8 output layer;
# gpt2-124m `trireme train` against HF + compile in fresh processes (3 repeats). Each part has a
# time limit and is skipped when the call's time is nearly spent; logs and JSON under $OUT.
set -uo pipefail
TOTAL=${TOTAL:-500}
. bench/gpu_part.sh
TAIL=45 part serve_profile 150 python bench/serve_profile.py --batches 1,64 --compile on \
    --out "$O/serve_profile-llama3-1b-compiled.json"
TAIL=6 part fp8_delayed_out 140 python bench/train_throughput.py --preset llama3-1b --warmup 3 \
    --steps 8 --compile --fused-cross-entropy --micro-batch-size 16 --override \
    model.precision=fp8 model.fp8_scaling=delayed \
    'model.fp8_layers=["qkv","out","fc1","fc2","output"]' \
    --out "$O/train_throughput-llama3-1b-fce-fp8-delayed-out-mb16.json"
TAIL=12 part fresh_gpt2 400 python bench/fresh_compare.py --preset gpt2-124m --repeats 3 \
    --steps 15 --log-interval 5 --system train --system "hf:--compile-hf --hf-tf32" \
    --out "$O/fresh_compare-gpt2-124m.json"
echo "== done at $SECONDS s"
