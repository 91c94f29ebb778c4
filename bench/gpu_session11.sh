#!/usr/bin/env bash
# Session 11's GPU calls (one call < 10 min; logs and JSON under $OUT, packed into one tarball):
#   bash bench/gpu_session11.sh qkv    # qkv through the split-K kernel (2 / 4 splits) against
#                                      # cuBLAS; then one bf16 / fp8 `trireme train` pair
#   bash bench/gpu_session11.sh fp8    # bf16 / fp8 `trireme train` pairs, alternated (issue 19)
#   bash bench/gpu_session11.sh fp8x3  # three pairs in one call (session 13)
#   bash bench/gpu_session11.sh gpt2   # gpt2-124m at micro batch 32 (the preset's), 64, 16,
#                                      # and compiled with max-autotune (model.compile_mode)
#   (no machine was lent in session 11: none of these has run yet)
#   (raw and chain were measured slower on the H200 in session 13 and removed)
set -uo pipefail
. bench/gpu_part.sh
OUT_DIR=${OUT:-bench/results}
O=$(mktemp -d)  # logs and JSON here, packed into one tarball under $OUT at the end
: "${TOTAL:=550}"
export PYTHONPATH=$PWD

pair() {  # I: `trireme train` llama3-1b as shipped, bf16 then fp8 (15 steps each)
    TAIL=4 part "bf16_$1" 120 train "bf16_$1" llama3-1b
    TAIL=4 part "fp8_$1" 120 train "fp8_$1" llama3-1b --model.precision=fp8
}

case "$1" in
qkv)
    step base_1 TRIREME_PDL=1
    step qkv4_1 TRIREME_SKINNY_SPLITS=3072x2048:4
    step qkv2_1 TRIREME_SKINNY_SPLITS=3072x2048:2
    step qkv4_2 TRIREME_SKINNY_SPLITS=3072x2048:4
    step base_2 TRIREME_PDL=1
    pair 1
    ;;
fp8)
    pair 2
    pair 3
    ;;
fp8x3)  # session 13: three bf16 / fp8 pairs in one call (the 1.3x from three fresh runs each)
    pair 1
    pair 2
    pair 3
    ;;
gpt2)  # issue 19: does a larger micro batch (fewer, larger GEMMs) take gpt2 toward 600k?
    for i in 1 2; do
        for mb in 32 64 16; do
            TAIL=4 part "gpt2_mb${mb}_$i" 90 train "gpt2_mb${mb}_$i" gpt2-124m \
                --train.micro_batch_size=$mb
        done
        TAIL=4 part "gpt2_autotune_$i" 240 train "gpt2_autotune_$i" gpt2-124m \
            --model.compile_mode=max-autotune-no-cudagraphs
    done
    ;;
esac
tar -czf "$OUT_DIR/session11-$1.tgz" -C "$O" . && ls "$O"
