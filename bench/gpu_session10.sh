#!/usr/bin/env bash
# Session 10's GPU calls (one call < 10 min; logs and JSON under $OUT, packed into one tarball):
#   (call 1, "tma": the v3 paged kernel against v2, ran at edae119; v3 is reverted, and that
#   case with it: git show edae119:bench/gpu_session10.sh)
#   bash bench/gpu_session10.sh pdl    # programmatic dependent launch in the decode step
#   bash bench/gpu_session10.sh check  # PDL's tokens, read rates, out / qkv split-K with PDL
#   bash bench/gpu_session10.sh verify # PDL on by default: serving x3, kernels, read rates
#   bash bench/gpu_session10.sh final  # out split four ways by default; serving, PDL off / on
#   bash bench/gpu_session10.sh fp8    # trireme train in fp8: the auto micro batch against 16
set -uo pipefail
. bench/gpu_part.sh
OUT_DIR=${OUT:-bench/results}
O=$(mktemp -d)  # logs and JSON here, packed into one tarball under $OUT at the end
: "${TOTAL:=540}"
export PYTHONPATH=$PWD

set -- "${1:-verify}"
case "$1" in
fp8)  # issue 19: trireme train in fp8 at the planner's micro batch (8) and at 16
    TAIL=6 part fp8_mb16 120 train fp8_mb16 llama3-1b --model.precision=fp8 \
        --train.micro_batch_size=16
    TAIL=6 part fp8_auto 120 train fp8_auto llama3-1b --model.precision=fp8
    ;;
final)  # the out projection split four ways by default: the decode step x3; serving at
    # concurrency 64 with PDL off and on, alternated (are the prompt steps' hosts slower?)
    S64="bench/serve_throughput.py --graphs on --concurrency 64 --num-prompts 256 \
        --bound-batches 1"
    for i in 1 2; do
        step final_step_$i
        TAIL=4 part serve64_pdl0_$i 60 env TRIREME_PDL=0 python $S64 --out "$O/s64-pdl0-$i.json"
        TAIL=4 part serve64_pdl1_$i 60 env TRIREME_PDL=1 python $S64 --out "$O/s64-pdl1-$i.json"
    done
    step final_step_3
    ;;
verify)  # PDL on by default: serving and the decode step (3 fresh runs), read rates, kernels,
    # then the out projection split four ways against not, alternated
    AB="bench/serve_throughput.py --graphs on --concurrency 1,16,64,256 --bound-batches 64"
    for i in 1 2 3; do
        TAIL=12 part serve_$i 90 python $AB --out "$O/serve-$i.json"
    done
    TAIL=12 part read_rate 40 python bench/read_rate.py --out "$O/read_rate.json"
    TAIL=30 part profile 80 python bench/serve_profile.py --batches 64 \
        --out "$O/serve_profile-llama3-1b.json"
    for i in 1 2; do
        step ab_out4_$i TRIREME_SKINNY_SPLITS=2048x2048:4
        step ab_base_$i TRIREME_PDL=1
    done
    ;;
check)  # PDL's tokens; the read rate by size; with PDL: out / qkv through the split-K kernel
    TAIL=4 part pdl_check 120 python bench/pdl_check.py --out "$O/pdl_check.json"
    TAIL=12 part read_rate 40 python bench/read_rate.py --out "$O/read_rate.json"
    step pdl TRIREME_PDL=1
    step pdl_out4 TRIREME_PDL=1 TRIREME_SKINNY_SPLITS=2048x2048:4
    step pdl_out4_qkv1 TRIREME_PDL=1 TRIREME_SKINNY_SPLITS=2048x2048:4,3072x2048:1
    step pdl_out1_qkv1 TRIREME_PDL=1 TRIREME_SKINNY_SPLITS=2048x2048:1,3072x2048:1
    step pdl_out4_2 TRIREME_PDL=1 TRIREME_SKINNY_SPLITS=2048x2048:4
    step pdl_2 TRIREME_PDL=1
    ;;
pdl)  # programmatic dependent launch: ours (TRIREME_PDL), Inductor's, both; alternated x2
    for i in 1 2; do
        step base_$i TRIREME_PDL=0
        step ours_$i TRIREME_PDL=1
        step inductor_$i TORCHINDUCTOR_ENABLE_PDL=1
        step both_$i TRIREME_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1
    done
    TAIL=30 part profile_both 80 env TRIREME_PDL=1 TORCHINDUCTOR_ENABLE_PDL=1 \
        python bench/serve_profile.py --batches 64 --out "$O/serve_profile-pdl.json"
    ;;
esac
tar -czf "$OUT_DIR/session10-$1.tgz" -C "$O" . && ls "$O"
