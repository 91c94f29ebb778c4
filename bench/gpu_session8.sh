#!/usr/bin/env bash
# Session 8's GPU calls (each < 10 min; logs and JSON under $OUT):
#   bash bench/gpu_session8.sh sweep   # the split-K decode GEMM sweep; serving as of now (gc freeze)
#   bash bench/gpu_session8.sh gemm    # decode step / serving with --decode-gemm triton vs cublas
#   bash bench/gpu_session8.sh ab      # serving A/B in fresh processes, 3 repeats each
#   bash bench/gpu_session8.sh parity  # fp8 loss (compiled and Triton loss kernels) against bf16, 300 steps
#   bash bench/gpu_session8.sh verify  # after the alignment fix: fresh machine, default vs cuBLAS vs compile_prefill
# Set PARTS (comma-separated part names) to run a subset; TOTAL bounds a call's seconds.
set -uo pipefail
CALL=${1:-sweep}
. bench/gpu_part.sh
: "${TOTAL:=560}"
SERVE="bench/serve_throughput.py --graphs on --concurrency 16,64,256"
case $CALL in
sweep)
    TAIL=40 part skinny 280 python bench/skinny_gemm.py --out "$O/skinny_gemm.json"
    TAIL=40 part serve 200 python $SERVE --bound-batches 64 \
        --out "$O/serve_throughput-llama3-1b.json"
    ;;
gemm)
    TAIL=30 part profile_cublas 120 python bench/serve_profile.py --batches 64 \
        --decode-gemm cublas --out "$O/serve_profile-cublas.json"
    TAIL=30 part profile_triton 120 python bench/serve_profile.py --batches 64 \
        --decode-gemm triton --out "$O/serve_profile-triton.json"
    TAIL=30 part serve_triton 200 python $SERVE --bound-batches 1,16,64,256 \
        --decode-gemm triton --out "$O/serve_throughput-llama3-1b-triton.json"
    ;;
ab)  # serving in fresh processes, 3 repeats of cuBLAS then Triton; one cuBLAS with PYTHONPATH
    # (a call brings back 8 files: the 7 logs, and the JSON files as one tar)
    AB="bench/serve_throughput.py --graphs on --concurrency 1,16,64,256 --bound-batches 64"
    J=/tmp/ab && mkdir -p $J
    for i in 1 2 3; do
        TAIL=12 part ab_cublas_$i 80 env -u PYTHONPATH python $AB --out "$J/ab-cublas-$i.json"
        TAIL=12 part ab_triton_$i 80 env -u PYTHONPATH python $AB --decode-gemm triton \
            --out "$J/ab-triton-$i.json"
    done
    TAIL=12 part ab_cublas_path 80 env PYTHONPATH="$PWD" python $AB --out "$J/ab-cublas-path.json"
    tar -czf "$O/ab-json.tar.gz" -C $J .
    ;;
verify)  # a fresh machine: no compile while serving now? then cuBLAS, compile_prefill, repeats
    AB="bench/serve_throughput.py --graphs on --concurrency 1,16,64,256 --bound-batches 64"
    J=/tmp/ab && mkdir -p $J
    TAIL=12 part v_triton_1 80 python $AB --out "$J/v-triton-1.json"
    TAIL=12 part v_cublas_1 80 python $AB --decode-gemm cublas --out "$J/v-cublas-1.json"
    TAIL=12 part v_prefill_1 150 python $AB --compile-prefill on --out "$J/v-prefill-1.json"
    TAIL=12 part v_triton_2 80 python $AB --out "$J/v-triton-2.json"
    TAIL=12 part v_prefill_2 150 python $AB --compile-prefill on --out "$J/v-prefill-2.json"
    TAIL=12 part v_triton_3 80 python $AB --out "$J/v-triton-3.json"
    tar -czf "$O/verify-json.tar.gz" -C $J .
    ;;
parity)  # issue 19's fp8 criterion: 300 steps of real text, fp8 (both loss kernels) against bf16
    CE=model.fused_cross_entropy_kernel
    TAIL=14 part parity_fp8_bf16 440 python bench/loss_parity.py --preset llama3-1b --steps 300 \
        --override model.seq_length=1024 train.global_batch_size=16 model.compile=true \
        model.fused_cross_entropy=true \
        --variant bf16:model.precision=bf16 \
        --variant fp8-compiled:model.precision=fp8,$CE=compiled \
        --variant fp8-triton:model.precision=fp8,$CE=triton \
        --out "$O/loss_parity-llama3-1b-fp8-vs-bf16.json"
    ;;
*)
    echo "usage: bash bench/gpu_session8.sh sweep|gemm|ab|verify|parity" >&2
    exit 2
    ;;
esac
echo "== done at $SECONDS s"
