#!/usr/bin/env bash
# Session 7's second GPU call (< 10 min; logs and JSON under $OUT):
#   bash bench/gpu_session7c.sh ab      # serving at 377812b (old377/, an untracked `git archive`
#                                       # of it) and now, one after the other on one machine
#   bash bench/gpu_session7c.sh splits  # the paged kernel's best settings by batch size
set -uo pipefail
CALL=${1:-ab}
. bench/gpu_part.sh
SERVE="bench/serve_throughput.py --graphs on --concurrency 16,64,256 --bound-batches 64"
case $CALL in
ab)
    : "${TOTAL:=560}"
    TAIL=10 part ab_old 110 env PYTHONPATH="$PWD/old377" python old377/$SERVE \
        --out "$O/serve_throughput-377812b.json"
    TAIL=10 part ab_new 110 python $SERVE --out "$O/serve_throughput-now.json"
    TAIL=10 part ab_old2 110 env PYTHONPATH="$PWD/old377" python old377/$SERVE \
        --out "$O/serve_throughput-377812b-2.json"
    TAIL=10 part ab_new2 110 python $SERVE --out "$O/serve_throughput-now-2.json"
    ;;
splits)
    : "${TOTAL:=560}"
    TAIL=40 part splits 200 python bench/serve_profile.py --kernel-configs \
        --batches 1,16,64,256 --variants v1,v2 --tiles 32,64 --warps 2 --splits 1,2,4,8,16 \
        --stages 2 --heads-first 0 --heads 1,2,4 --prefetch 0 --max-seconds 190 \
        --out "$O/serve_kernel_configs-by-batch.json"
    ;;
esac
echo "== done at $SECONDS s"
