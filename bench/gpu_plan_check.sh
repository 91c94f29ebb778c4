#!/usr/bin/env bash
# One H200 call (issue 20, about 6 minutes): the planner's rate table measured here, then the
# planner against measured runs, eager (the five configurations) and compiled (the shipped
# default: bf16 micro batch 8; and fp8 micro batch 4), then both result files predicted again
# with the measured table. Each part under its own time limit; logs and JSON under $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-bench/results}
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 90 python -m trireme plan --calibrate --out "$O/rates-h200-calibrated.json" \
    2>&1 | tee "$O/calibrate.log" | tail -32
timeout 170 python bench/plan_accuracy.py --warmup 2 --steps 3 --override model.compile=false \
    --out "$O/plan_accuracy-h200.json" 2>&1 | tee "$O/plan_eager.log" | tail -9
timeout 150 python bench/plan_accuracy.py --warmup 3 --steps 3 --only none-mb8 fp8-mb4 \
    --override model.compile=true --out "$O/plan_accuracy-h200-compiled.json" 2>&1 \
    | tee "$O/plan_compiled.log" | tail -6
for f in plan_accuracy-h200 plan_accuracy-h200-compiled; do
    [ -f "$O/$f.json" ] && [ -f "$O/rates-h200-calibrated.json" ] && timeout 30 python bench/plan_accuracy.py --repredict "$O/$f.json" \
        --gpu "$O/rates-h200-calibrated.json" 2>&1 | tee -a "$O/repredict.log"
done
