#!/usr/bin/env bash
# Session 7's first GPU call (< 10 min; logs and JSON under $OUT): the paged decode kernel's launch
# settings swept wider than session 6's (warps, stages, tiles; v1 and v2 at batch 64), then
# serving end to end on a fresh machine (the kernels compiled at engine start).
#   bash bench/gpu_session7b.sh sweep
set -uo pipefail
CALL=${1:-sweep}
. bench/gpu_part.sh
case $CALL in
sweep)
    : "${TOTAL:=560}"
    TAIL=24 part sweep_v1 150 python bench/serve_profile.py --kernel-configs --batches 64 \
        --variants v1 --tiles 16,32,64 --warps 2,4,8 --splits 0,2 --stages 0,2,4 \
        --heads-first 0 --max-seconds 130 --out "$O/serve_kernel_configs-v1-wide.json"
    TAIL=24 part sweep_v2 170 python bench/serve_profile.py --kernel-configs --batches 64 \
        --variants v2 --tiles 16,32,64 --warps 2,4,8 --splits 2,4 --stages 0,2,4 --heads 1,2,4 \
        --prefetch 0 --max-seconds 150 --out "$O/serve_kernel_configs-v2-wide.json"
    TAIL=16 part serve_cold 200 python bench/serve_throughput.py --graphs on \
        --out "$O/serve_throughput-llama3-1b.json"
    ;;
esac
echo "== done at $SECONDS s"
