#!/usr/bin/env bash
# The compiled decode step's fusions (issue 17: q and k RoPE'd as one tensor, v uncopied, the last
# residual add fused with the next layer's input norm), one H200 call (< 10 min; logs and JSON
# under $OUT): Inductor's kernels per piece before and after, the batch 1 and 64 decode step
# (its kernel table: the RoPE, v-copy, add and norm kernels should be gone or merged), and the
# compiled step's accuracy against an fp32 reference (it must stay no worse than eager's).
#   bash bench/gpu_s7_dec.sh
set -uo pipefail
. bench/gpu_part.sh
: "${TOTAL:=560}"
TAIL=12 part decode_kernels 150 python bench/decode_kernels.py \
    --out "$O/decode_kernels-llama3-1b.json"
TAIL=30 part serve_profile 150 python bench/serve_profile.py --batches 1,64 \
    --out "$O/serve_profile-llama3-1b.json"
TAIL=30 part decode_numerics 200 python bench/decode_numerics.py --temperature-scale 1 \
    --out "$O/decode_numerics-llama3-1b.json"
echo "== done at $SECONDS s"
