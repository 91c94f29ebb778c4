#!/usr/bin/env bash
# What session 6 left unmeasured, for one H200 (each call < 10 min; logs and JSON under $OUT).
#   bash bench/gpu_session7.sh serve   # on a fresh machine (an empty Triton cache, as a user's):
#                                      # serving end to end with the kernels compiled at engine
#                                      # start, the decode step, v2 at its best batch-64 setting
#   bash bench/gpu_session7.sh train   # `trireme train` bf16 and fp8 with the Triton loss kernel
#                                      # as the default (the fp8 output layer keeps the compiled one)
# Set PARTS (comma-separated part names) to run a subset; TOTAL bounds a call's seconds.
set -uo pipefail
CALL=${1:-serve}
. bench/gpu_part.sh
case $CALL in
serve)
    : "${TOTAL:=560}"
    TAIL=16 part serve_cold 150 python bench/serve_throughput.py --graphs on \
        --out "$O/serve_throughput-llama3-1b.json"
    TAIL=16 part serve_warm 120 python bench/serve_throughput.py --graphs on \
        --out "$O/serve_throughput-llama3-1b-warm-cache.json"
    TAIL=30 part serve_profile 90 python bench/serve_profile.py --batches 1,64 \
        --out "$O/serve_profile-llama3-1b.json"
    TAIL=16 part serve_v2 150 env TRIREME_PAGED_KERNEL=v2,tile=32,heads=4 python \
        bench/serve_throughput.py --graphs on --out "$O/serve_throughput-llama3-1b-v2.json"
    ;;
train)
    : "${TOTAL:=330}"
    part bf16_train 110 train llama3-1b-bf16 llama3-1b
    part fp8_train 110 train llama3-1b-fp8 llama3-1b --model.precision=fp8
    TAIL=4 part gpt2 70 python3 bench/train_throughput.py --preset gpt2-124m --compile \
        --fused-cross-entropy --out "$O/train_throughput-gpt2-124m.json"
    ;;
esac
echo "== done at $SECONDS s"
