#!/usr/bin/env bash
# The session-5 GPU calls (one H200, 2026-12-03), each < 10 min; logs and JSON under $OUT.
#   bash bench/gpu_session5.sh a   # carry .whlA: stash the CuTe DSL cu13 runtime in /tmp/fa; fp8
#                                  # loss parity (300 steps, real text); gpt2-124m profile
#   bash bench/gpu_session5.sh b   # carry .whlB, on the same warm machine: install flash-attn-4,
#                                  # quack and the cutlass DSL; kernel_choices; llama3-1b with fa4
#   bash bench/gpu_session5.sh c   # serving: compiled vs eager decode numerics, HF generate
#                                  # baseline, paged-kernel v2 sweep
#   bash bench/gpu_session5.sh d   # llama3-1b `trireme train` against HF + compile, fresh processes
# The cu13 runtime wheel (92 MB) is over one call's 64 MiB, so call a carries its two shared
# libraries (xz -9e: 50 + 13.5 MB) and call b the other wheels; .whlA / .whlB are git-ignored.
set -uo pipefail
CALL=${1:-a}
PARTS=${PARTS:-stash,parity,profile_gpt2,gpt2_mb64,numerics,install,kernels,fa4_train,cudnn_train,serve_hf,kernel_sweep,fresh_llama}
. bench/gpu_part.sh
ALL='model.fp8_layers=["qkv","out","fc1","fc2","output"]'
export O IR=nvidia_cutlass_dsl/dsl_packages/cutlass/_mlir/_mlir_libs/_cutlass_ir.cu13.cpython-312-x86_64-linux-gnu.so
stash() {
    mkdir -p /tmp/fa/site && tar -xJf .whlA/cu13-rest.tar.xz -C /tmp/fa/site \
        && mkdir -p "/tmp/fa/site/$(dirname $IR)" && xz -dc .whlA/ir.so.xz > "/tmp/fa/site/$IR.tmp" \
        && mv "/tmp/fa/site/$IR.tmp" "/tmp/fa/site/$IR" && du -sh /tmp/fa/site
}
install() {
    [ -f "/tmp/fa/site/$IR" ] || { echo "no /tmp/fa/site: the machine is not the one of call a"; return 1; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whlB/*.whl && cp -a /tmp/fa/site/. /tmp/site/ \
        && PYTHONPATH=$FA_PATH python3 -c "import cutlass, flash_attn.cute, quack; print('imports ok')"
}
train() {  # name, overrides...: `trireme train` llama3-1b as shipped, 15 steps
    local name=$1; shift
    python -m trireme train --config llama3-1b --data.mock=true --train.steps=15 \
        --train.log_interval=3 --train.eval_interval=0 --train.sample_tokens=0 \
        --logging.progress=false --logging.tensorboard=false --run.dir="/tmp/$name" "$@"
}
case $CALL in
a)
    : "${TOTAL:=400}"
    part stash 60 stash
    TAIL=14 part parity 300 python bench/loss_parity.py --preset llama3-1b --steps 300 \
        --tag llama3-1b-seq1024-fp8-delayed \
        --override model.seq_length=1024 train.global_batch_size=8 model.compile=true \
        model.fused_cross_entropy=true \
        --variant bf16:model.precision=bf16 \
        --variant "fp8-delayed-out:model.precision=fp8,model.fp8_scaling=delayed,$ALL" \
        --out "$O/loss_parity-llama3-1b-seq1024-fp8-delayed.json"
    TAIL=45 part profile_gpt2 100 python bench/profile_step.py --preset gpt2-124m --compile \
        --global-batch-size 64 --steps 2 --warmup 3 --tag gpt2-124m-compile \
        --override model.fused_cross_entropy=true --out "$O/profile-gpt2-124m-compile.json"
    ;;
b)
    : "${TOTAL:=420}"
    export FA_PATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages
    part install 60 install && export PYTHONPATH=$FA_PATH:${PYTHONPATH:-}
    TAIL=60 part kernels 200 python bench/kernel_choices.py --ops attention,rmsnorm,rope,loss \
        --budget-s 60 --total-budget-s 190 --out "$O/kernel_choices-fa4-quack.json"
    part fa4_train 90 train fa4 --model.attention_backend=fa4
    part cudnn_train 90 train cudnn
    for r in fa4 cudnn; do cp "/tmp/$r/metrics.jsonl" "$O/train-llama3-1b-$r-metrics.jsonl" 2>/dev/null; done
    ;;
c)
    : "${TOTAL:=420}"
    TAIL=30 part numerics 150 python bench/decode_numerics.py --temperature-scale 1 \
        --out "$O/decode_numerics-llama3-1b.json"
    TAIL=40 part serve_hf 250 python bench/serve_throughput.py --graphs on --baseline hf \
        --out "$O/serve_throughput-llama3-1b-hf.json"
    TAIL=40 part kernel_sweep 160 python bench/serve_profile.py --kernel-configs --batches 64,1 \
        --variants v1,v2 --tiles 16,32,64 --warps 4,8 --splits 0 --heads 1,2,4 --heads-first 0,1 \
        --prefetch 0,1 --max-seconds 140 --out "$O/serve_profile-kernel-sweep.json"
    ;;
d)
    : "${TOTAL:=560}"
    TAIL=20 part fresh_llama 550 python bench/fresh_compare.py --preset llama3-1b --repeats 3 \
        --steps 12 --log-interval 3 --timeout 150 --system train --system "hf:--compile-hf --hf-tf32" \
        --out "$O/fresh_compare-llama3-1b.json"
    ;;
esac
echo "== done at $SECONDS s"
