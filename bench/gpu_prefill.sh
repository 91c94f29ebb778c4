#!/usr/bin/env bash
# The compiled prompt / mixed steps (EngineSettings.compile_prefill, --compile-prefill) against
# the eager ones, on one H200 (one call < 10 min; logs and JSON under $OUT):
#   bash bench/gpu_prefill.sh steps   # serve_mixed: prefill / mixed step wall, host and kernels
#   bash bench/gpu_prefill.sh serve   # serve_throughput at concurrency 16 and 64: TTFT, TPOT
# Set PARTS (comma-separated part names) to run a subset; TOTAL bounds a call's seconds.
set -uo pipefail
CALL=${1:-steps}
. bench/gpu_part.sh
case $CALL in
steps)
    : "${TOTAL:=560}"
    TAIL=16 part mixed_off 200 python bench/serve_mixed.py --compile-prefill off \
        --out "$O/serve_mixed-llama3-1b.json"
    TAIL=16 part mixed_on 300 python bench/serve_mixed.py --compile-prefill on \
        --out "$O/serve_mixed-llama3-1b-compile-prefill.json"
    ;;
serve)
    : "${TOTAL:=560}"
    TAIL=12 part serve_off 240 python bench/serve_throughput.py --graphs on \
        --concurrency 16,64 --bound-batches 64 --compile-prefill off \
        --out "$O/serve_throughput-llama3-1b.json"
    TAIL=12 part serve_on 300 python bench/serve_throughput.py --graphs on \
        --concurrency 16,64 --bound-batches 64 --compile-prefill on \
        --out "$O/serve_throughput-llama3-1b-compile-prefill.json"
    ;;
*)
    echo "usage: bash bench/gpu_prefill.sh steps|serve" >&2
    exit 2
    ;;
esac
