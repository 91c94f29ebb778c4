#!/usr/bin/env bash
# Session 7's third GPU call (< 10 min; logs and JSON under $OUT): serving at 377812b (old377/,
# an untracked `git archive` of it with its configs/) against now (v2 paged kernel by default,
# the compiled decode's fused RoPE and handed-on norm) on one machine, the decode step's kernels,
# and the compiled step's numerics.
#   bash bench/gpu_session7d.sh
set -uo pipefail
. bench/gpu_part.sh
: "${TOTAL:=560}"
SERVE="bench/serve_throughput.py --graphs on --concurrency 16,64,256"
TAIL=10 part ab_old 110 env PYTHONPATH="$PWD/old377" python old377/$SERVE --bound-batches 64 \
    --out "$O/serve_throughput-377812b.json"
TAIL=16 part ab_new 150 python $SERVE --bound-batches 1,16,64,256 \
    --out "$O/serve_throughput-llama3-1b.json"
TAIL=30 part serve_profile 130 python bench/serve_profile.py --batches 1,64 \
    --out "$O/serve_profile-llama3-1b.json"
TAIL=20 part decode_numerics 150 python bench/decode_numerics.py --temperature-scale 1 \
    --out "$O/decode_numerics-llama3-1b.json"
echo "== done at $SECONDS s"
