#!/usr/bin/env bash
# The Triton loss kernel's e5m2 output for the fp8 output layer (issue 19, "FP8 >= 1.3x bf16"), on
# one H200 (each call < 10 min; logs and JSON under $OUT):
#   bash bench/gpu_fp8_ce.sh kernels  # the CUDA tests, then the fp8 chunk step and the fp8 head:
#                                     # Triton against compiled at the llama3-1b shape
#   bash bench/gpu_fp8_ce.sh parity   # 300 steps of llama3-1b fp8: Triton against compiled, and
#                                     # compiled at another loss chunk size (the neutral drift;
#                                     # about 110 s a variant, the JSON written at the end)
#   bash bench/gpu_fp8_ce.sh train    # `trireme train` llama3-1b: bf16, fp8 (Triton: the default
#                                     # now), fp8 with the compiled softmax part
# Set PARTS (comma-separated part names) to run a subset; TOTAL bounds a call's seconds.
set -uo pipefail
CALL=${1:-kernels}
. bench/gpu_part.sh
CE=model.fused_cross_entropy_kernel
case $CALL in
kernels)
    : "${TOTAL:=560}"
    TAIL=12 part ce_tests 150 python3 -m pytest tests/test_cross_entropy_triton.py -q -x -s \
        -k "cuda or sm90 or e5m2 or fp8"
    TAIL=24 part ce_fp8_kernels 360 python3 bench/kernel_choices.py \
        --ops ce_step_fp8,ce_step,fp8_loss --total-budget-s 330 \
        --out "$O/kernel_choices_fp8_loss.json"
    ;;
parity)
    : "${TOTAL:=560}"
    TAIL=14 part parity_fp8 540 python bench/loss_parity.py --preset llama3-1b --steps 300 \
        --override model.seq_length=1024 train.global_batch_size=16 model.compile=true \
        model.fused_cross_entropy=true model.precision=fp8 \
        --variant compiled:$CE=compiled --variant triton:$CE=triton \
        --variant compiled-chunk2048:$CE=compiled,model.loss_chunk_size=2048 \
        --out "$O/loss_parity-llama3-1b-fp8-ce-triton.json"
    ;;
train)
    : "${TOTAL:=400}"
    part bf16_train 120 train llama3-1b-bf16 llama3-1b
    part fp8_train 120 train llama3-1b-fp8 llama3-1b --model.precision=fp8
    part fp8_compiled_train 120 train llama3-1b-fp8-ce-compiled llama3-1b --model.precision=fp8 \
        --$CE=compiled
    ;;
esac
echo "== done at $SECONDS s"
