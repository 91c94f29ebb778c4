#!/usr/bin/env bash
# Prepared in session 8 for the next GPU session (one call < 10 min; logs and JSON under $OUT):
# the fused gate_up + SwiGLU kernel's sweep (to fill trireme.ops.skinny_gemm.GLU_TILES, or
# not), the decode step with the review's changes to the split-K path (warm-up, class swap),
# and where a loaded server's mixed step spends its time (the prompt steps are 60-85% of the
# wall time at concurrency 64-256), eager and compiled.
#   bash bench/gpu_session9.sh
set -uo pipefail
. bench/gpu_part.sh
: "${TOTAL:=560}"
export PYTHONPATH=$PWD
TAIL=12 part glu 150 python bench/skinny_gemm.py --gemms down --batches 1,16,64 --glu --quick \
    --out "$O/skinny_gemm-glu.json"
TAIL=30 part profile 110 python bench/serve_profile.py --batches 64 \
    --out "$O/serve_profile-llama3-1b.json"
TAIL=16 part mixed_off 120 python bench/serve_mixed.py --batch 256 --mixed-prompt 1800 \
    --out "$O/serve_mixed-256.json"
TAIL=16 part mixed_on 180 python bench/serve_mixed.py --batch 256 --mixed-prompt 1800 \
    --compile-prefill on --out "$O/serve_mixed-256-compile-prefill.json"
echo "== done at $SECONDS s"
