#!/usr/bin/env bash
# One H200 call (issue 20, under 2 minutes): the planner's rate table measured here with
# `trireme plan --calibrate` (warnings for any rate 2x off the shipped h200 table), then the
# stored accuracy runs (bench/results/plan_accuracy-h200.json, eager, five configurations;
# plan_accuracy-h200-compiled.json, compiled bf16 mb 8 and fp8 mb 4; measured 2026-12-03 by the
# earlier version of this script) predicted again with the measured table and with the shipped
# one. Logs and JSON under $OUT (default bench/results).
set -uo pipefail
export PYTHONUNBUFFERED=1
O=${OUT:-bench/results}
R=bench/results
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
timeout 90 python -m trireme plan --calibrate --out "$O/rates-h200-calibrated.json" \
    2>&1 | tee "$O/calibrate.log" | tail -32
for f in plan_accuracy-h200 plan_accuracy-h200-compiled; do
    for table in "$O/rates-h200-calibrated.json" h200; do
        [ -f "$table" ] || [ "$table" = h200 ] || continue
        echo "== $f predicted with $table"
        timeout 30 python bench/plan_accuracy.py --repredict "$R/$f.json" --gpu "$table" 2>&1 \
            | tail -9
    done
done 2>&1 | tee "$O/repredict.log"
