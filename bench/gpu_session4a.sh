#!/usr/bin/env bash
# One H200 call (session 4, 2026-12-03): where a serving decode step's time goes, and the
# honest gpt2-124m comparison (fresh processes, alternated, 3 repeats). Logs and JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 150 python bench/serve_profile.py --batches 1,64 --out "$O/serve_profile-llama3-1b.json" \
    2>&1 | grep -v USDT | tee "$O/serve_profile.log" | tail -70
timeout 400 python bench/fresh_compare.py --preset gpt2-124m --repeats 3 --steps 30 \
    --system train --system "hf:--compile-hf --hf-tf32" \
    --out "$O/fresh_compare-gpt2-124m.json" 2>&1 | tee "$O/fresh_gpt2.log" | tail -12
