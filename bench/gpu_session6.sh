#!/usr/bin/env bash
# What session 5 built without a GPU, to measure on one H200 (each call < 10 min; logs and JSON
# under $OUT). flash-attn-4 needs the cutlass DSL runtime carried over two calls on one warm
# machine as in bench/gpu_session5.sh (`a` then `b`, the second issued at once).
#   bash bench/gpu_session6.sh serve   # prefill/mixed steps after the cuDNN fix; compiled decode
#                                      # by default; GEMM autotuning and split-context paged kernels
#   bash bench/gpu_session6.sh loss    # the Triton loss-gradient kernel against the compiled one
#   bash bench/gpu_session6.sh parity  # 300 steps: Triton loss kernel against the compiled one
#   bash bench/gpu_session6.sh final   # the decode step after the fused KV store and greedy kernel
#   bash bench/gpu_session6.sh fp8     # fp8 defaults (delayed, output layer) as `trireme train` runs them
set -uo pipefail
CALL=${1:-serve}
. bench/gpu_part.sh
case $CALL in
serve)
    : "${TOTAL:=560}"
    TAIL=25 part serve_mixed_before 150 python bench/serve_mixed.py --sdpa-order cudnn-first
    TAIL=25 part serve_mixed 150 python bench/serve_mixed.py
    TAIL=30 part serve_profile 120 python bench/serve_profile.py --batches 1,64 \
        --out "$O/serve_profile-llama3-1b.json"
    TAIL=20 part serve_autotune 150 env TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 python \
        bench/serve_profile.py --batches 64 --out "$O/serve_profile-llama3-1b-autotune.json"
    TAIL=12 part kernel_splits 120 python bench/serve_profile.py --kernel-configs --batches 64 \
        --variants v1,v2 --tiles 32,64 --warps 4 --splits 1,2,4 --heads 2,4,8 --heads-first 0 \
        --prefetch 0 --max-seconds 100 --out "$O/serve_profile-kernel-splits.json"
    TAIL=30 part serve_default 200 python bench/serve_throughput.py --graphs on \
        --out "$O/serve_throughput-llama3-1b.json"
    TAIL=30 part serve_off 200 python bench/serve_throughput.py --graphs on --compile-decode off \
        --out "$O/serve_throughput-llama3-1b-eager.json"
    ;;
loss)
    : "${TOTAL:=560}"
    part ce_tests 90 python3 -m pytest tests/test_cross_entropy_triton.py \
        tests/test_fused_cross_entropy.py -q -x
    TAIL=80 part ce_kernels 200 python3 bench/kernel_choices.py \
        --ops loss,loss_gpt2,ce_step,ce_step_gpt2 --out "$O/kernel_choices_loss.json"
    for k in compiled triton; do
        TAIL=4 part gpt2_ce_$k 120 python3 bench/train_throughput.py --preset gpt2-124m --compile \
            --fused-cross-entropy --override model.fused_cross_entropy_kernel=$k \
            --out "$O/train_throughput-gpt2-124m-ce-$k.json"
    done
    ;;
parity)  # the Triton loss kernel as a default: 300 steps of real text against the compiled one,
    # and the compiled one against itself at another loss chunk size (a neutral change of the
    # order of fp32 sums: how far two runs drift apart without any change of the math)
    : "${TOTAL:=560}"
    CE=model.fused_cross_entropy_kernel
    TAIL=14 part parity_gpt2-124m 200 python bench/loss_parity.py --preset gpt2-124m --steps 300 \
        --override model.seq_length=1024 train.global_batch_size=32 train.micro_batch_size=32 \
        model.compile=true model.fused_cross_entropy=true \
        --variant compiled:$CE=compiled --variant compiled-chunk2048:$CE=compiled,model.loss_chunk_size=2048 \
        --variant triton:$CE=triton --out "$O/loss_parity-gpt2-124m-ce-triton.json"
    TAIL=14 part parity_llama3-1b 300 python bench/loss_parity.py --preset llama3-1b --steps 300 \
        --override model.seq_length=1024 train.global_batch_size=16 model.compile=true \
        model.fused_cross_entropy=true model.loss_chunk_size=2048 \
        --variant compiled-chunk2048:$CE=compiled --variant triton-chunk2048:$CE=triton \
        --out "$O/loss_parity-llama3-1b-ce-triton-chunk2048.json"
    ;;
final)  # after the fused KV store and the fused greedy/finite kernel: the decode step again
    : "${TOTAL:=400}"
    TAIL=20 part argmax_check 40 python bench/argmax_check.py --out "$O/argmax_check.json"
    TAIL=12 part store_check 60 python bench/serve_profile.py --kernel-configs --batches 64,1 \
        --variants v1 --tiles 64 --warps 4 --splits 0 --heads-first 0 --max-seconds 40 \
        --out "$O/serve_kernel_configs-fused-store.json"
    TAIL=30 part serve_profile_final 80 python bench/serve_profile.py --batches 1,64 \
        --out "$O/serve_profile-llama3-1b-final.json"
    TAIL=16 part serve_final 60 python bench/serve_throughput.py --graphs on \
        --out "$O/serve_throughput-llama3-1b-final.json"
    TAIL=16 part serve_final_v2 60 env TRIREME_PAGED_KERNEL=v2,tile=32,heads=4 python \
        bench/serve_throughput.py --graphs on --out "$O/serve_throughput-llama3-1b-final-v2.json"
    TAIL=4 part gpt2_default 50 python3 bench/train_throughput.py --preset gpt2-124m --compile \
        --fused-cross-entropy --out "$O/train_throughput-gpt2-124m-default.json"
    TAIL=4 part gpt2_cudagraphs 60 env TORCHINDUCTOR_CUDAGRAPHS=1 python3 \
        bench/train_throughput.py --preset gpt2-124m --compile --fused-cross-entropy \
        --out "$O/train_throughput-gpt2-124m-inductor-cudagraphs.json"
    TAIL=30 part serve_profile_separate 60 python bench/serve_profile.py --batches 64 \
        --kv-store separate --out "$O/serve_profile-llama3-1b-separate.json"
    ;;
fp8)
    : "${TOTAL:=300}"
    part fp8_train 120 train llama3-1b-fp8 llama3-1b --model.precision=fp8
    part bf16_train 120 train llama3-1b-bf16 llama3-1b
    ;;
esac
echo "== done at $SECONDS s"
