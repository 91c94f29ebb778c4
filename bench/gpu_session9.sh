#!/usr/bin/env bash
# Session 9's GPU calls (one call < 10 min; logs and JSON under $OUT, packed into one tarball):
#   bash bench/gpu_session9.sh diag    # the fused gate_up + SwiGLU sweep, the step's kernels,
#                                      # and the paged kernel alone with and without the new key
#   bash bench/gpu_session9.sh verify  # after the fixes: serving x3, kernels, pool layouts
set -uo pipefail
. bench/gpu_part.sh
: "${TOTAL:=540}"
export PYTHONPATH=$PWD
case "${1:-diag}" in
diag)
    TAIL=14 part glu 150 python bench/skinny_gemm.py --gemms down --batches 1,16,64 --glu --quick \
        --out "$O/skinny_gemm-glu.json"
    TAIL=30 part profile 110 python bench/serve_profile.py --batches 64 \
        --out "$O/serve_profile-llama3-1b.json"
    TAIL=30 part paged 150 python bench/serve_profile.py --kernel-configs --batches 64 \
        --variants v2 --tiles 64,128 --warps 2,4 --splits 0,2 --heads 2,8 --prefetch 0 \
        --stages 0,3 --out "$O/serve_kernel_configs-64.json"
    ;;
verify)  # the swapped tile fixed, the fused gate_up + SwiGLU on: serving and the decode step
    # (3 fresh runs), the step's kernels, the paged kernel by pool layout, the GLU sweep again
    AB="bench/serve_throughput.py --graphs on --concurrency 1,16,64,256 --bound-batches 64"
    for i in 1 2 3; do
        TAIL=12 part serve_$i 85 python $AB --out "$O/serve-$i.json"
    done
    TAIL=30 part profile 80 python bench/serve_profile.py --batches 64 \
        --out "$O/serve_profile-llama3-1b.json"
    SWEEP="--kernel-configs --batches 64 --variants v2 --tiles 16,32,64 --warps 2,4 \
        --splits 0,4 --heads 1,2,8 --prefetch 0 --max-seconds 75"
    for layout in pos head; do
        TAIL=8 part paged_$layout 95 python bench/serve_profile.py $SWEEP --layout $layout \
            --out "$O/serve_kernel_configs-$layout.json"
    done
    TAIL=8 part glu 60 python bench/skinny_gemm.py --gemms down --batches 1,16 --glu --quick \
        --out "$O/skinny_gemm-glu.json"
    ;;
prefetch)  # the small GEMMs' weights prefetched into the L2 beside the paged kernel?
    TAIL=30 part l2 120 python bench/l2_prefetch.py --out "$O/l2_prefetch.json"
    ;;
mixed)  # where a loaded server's prompt steps go, eager and compiled; the other batch sizes
    TAIL=16 part mixed_off 120 python bench/serve_mixed.py --batch 256 --mixed-prompt 1800 \
        --out "$O/serve_mixed-256.json"
    TAIL=16 part mixed_on 180 python bench/serve_mixed.py --batch 256 --mixed-prompt 1800 \
        --compile-prefill on --out "$O/serve_mixed-256-compile-prefill.json"
    TAIL=8 part bound 100 python bench/serve_throughput.py --graphs on --concurrency 1 \
        --num-prompts 16 --bound-batches 1,16,64,256 --out "$O/serve_bound.json"
    ;;
rope)  # RoPE folded into the paged kernel (ca58ce6, reverted after this call and rope_kernel):
    # serving and the decode step (3 fresh runs), kernels
    AB="bench/serve_throughput.py --graphs on --concurrency 1,16,64,256 --bound-batches 64"
    for i in 1 2 3; do
        TAIL=12 part rope_serve_$i 85 python $AB --out "$O/rope-serve-$i.json"
    done
    TAIL=30 part rope_profile 80 python bench/serve_profile.py --batches 64 \
        --out "$O/rope-serve_profile-llama3-1b.json"
    ;;
rope_kernel)  # the paged kernel alone: stored keys, fused, fused + RoPE (36ff37f), by setting
    for spec in "" "v2,num_warps=4" "v2,tile=32" "v2,heads=1" "v2,num_stages=3"; do
        TAIL=3 part "rk_${spec//[,=]/_}" 60 env TRIREME_PAGED_KERNEL="$spec" \
            python bench/serve_profile.py --kernel-configs --batches 64 --variants v2 \
            --tiles 64 --warps 2 --splits 0 --heads 2 --prefetch 0 \
            --out "$O/rk-${spec//[,=]/_}.json"
    done
    ;;
joint)  # q and k RoPE'd together in the eager forward: prompt and mixed steps, serving once
    TAIL=16 part joint_mixed 120 python bench/serve_mixed.py --batch 256 --mixed-prompt 1800 \
        --out "$O/joint-serve_mixed-256.json"
    TAIL=12 part joint_serve 90 python bench/serve_throughput.py --graphs on \
        --concurrency 1,16,64,256 --bound-batches 64 --out "$O/joint-serve.json"
    ;;
joint_ab)  # the same machine: 93665d1 (q, k rotated apart) against this; the copy, carried:
    # mkdir .old && git archive 93665d1 trireme configs bench/serve_mixed.py \
    #     bench/serve_throughput.py | tar -x -C .old   (call 9 lacked configs/; call 10 ran one
    # pair by hand)
    for i in 1 2; do
        TAIL=14 part ab_apart_$i 75 python .old/bench/serve_mixed.py --batch 256 \
            --mixed-prompt 1800 --reps 12 --out "$O/ab-apart-$i.json"
        TAIL=14 part ab_joint_$i 75 python bench/serve_mixed.py --batch 256 \
            --mixed-prompt 1800 --reps 12 --out "$O/ab-joint-$i.json"
    done
    ;;
esac
echo "== done at $SECONDS s"
cd "$O" && tar czf session9.tgz --remove-files ./*.json ./*.log 2>/dev/null; ls "$O"
