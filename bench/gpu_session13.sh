#!/usr/bin/env bash
# The next GPU session's calls (written in session 13, after its device time ran out; one call
# < 10 min; logs and JSON under $OUT, packed into one tarball):
#   bash bench/gpu_session13.sh fp8     # issue 19: bf16, fp8 and fp8 with the weights cast in
#                                       # every forward (the plain path), three times each,
#                                       # alternated: does casting W once per step take fp8
#                                       # past 1.3x bf16 (1.2986x in session 13)?
#   bash bench/gpu_session13.sh decode  # issue 17: the decode step with qkv split 4 / 2 ways,
#                                       # the early L2 prefetch, both; the prefetch's tokens
set -uo pipefail
. bench/gpu_part.sh
OUT_DIR=${OUT:-bench/results}
O=$(mktemp -d)
: "${TOTAL:=560}"
export PYTHONPATH=$PWD

train_plain() {  # NAME PRESET OVERRIDES...: `train`, the fp8 weights cast in every forward
    local name=$1 preset=$2; shift 2
    python -c "import sys; from trireme.ops.fp8_training import DelayedFloat8Linear as L
L.cache_weight = False
from trireme.cli import main
sys.exit(main(sys.argv[1:]))" train --config "$preset" --data.mock=true --train.steps=15 \
        --train.log_interval=3 --train.eval_interval=0 --train.sample_tokens=0 \
        --logging.progress=false --logging.tensorboard=false --run.dir="/tmp/$name" "$@" \
        && cp "/tmp/$name/metrics.jsonl" "$O/train-$name-metrics.jsonl"
}

case "$1" in
fp8)
    for i in 1 2 3; do
        TAIL=4 part "bf16_$i" 100 train "bf16_$i" llama3-1b
        TAIL=4 part "fp8_$i" 100 train "fp8_$i" llama3-1b --model.precision=fp8
        TAIL=4 part "fp8_plain_$i" 100 train_plain "fp8_plain_$i" llama3-1b \
            --model.precision=fp8
    done
    ;;
decode)
    TAIL=4 part prefetch_check 100 python bench/pdl_check.py --env TRIREME_PDL_PREFETCH \
        --values 0,1 --out "$O/prefetch_check.json"
    for i in 1 2; do
        step base_$i TRIREME_PDL=1
        step qkv4_$i TRIREME_SKINNY_SPLITS=3072x2048:4
        step qkv2_$i TRIREME_SKINNY_SPLITS=3072x2048:2
        step pre_$i TRIREME_PDL_PREFETCH=1
        step qkv4_pre_$i TRIREME_SKINNY_SPLITS=3072x2048:4 TRIREME_PDL_PREFETCH=1
    done
    ;;
*) echo "usage: bash bench/gpu_session13.sh fp8|decode"; exit 2 ;;
esac
tar -czf "$OUT_DIR/session13-$1.tgz" -C "$O" . && ls "$O"
