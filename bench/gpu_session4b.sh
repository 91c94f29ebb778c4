#!/usr/bin/env bash
# One H200 call (session 4, 2026-12-03, about 9.5 minutes): serving after the compiled decode
# forward and the host overlap; gpt2-124m `trireme train` after the aligned loss and the pinned
# batches; the planner's calibration again; liger-kernel and torchao against ours. Each part has a
# time limit and is skipped when the call's time is nearly spent; logs and JSON under $OUT.
set -uo pipefail
TOTAL=${TOTAL:-560}
PARTS=${PARTS:-serve_profile,train_gpt2,plan_check,serve_throughput,kernel_choices}
. bench/gpu_part.sh
if [ -d .whl3 ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl3/*.whl && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
fi
TAIL=40 part serve_profile 200 python bench/serve_profile.py --batches 1,64 --compile on \
    --out "$O/serve_profile-llama3-1b-compiled.json"
part train_gpt2 100 python -m trireme train --config gpt2-124m --data.mock=true --train.steps=30 \
    --train.log_interval=5 --train.eval_interval=0 --train.sample_tokens=0 \
    --logging.progress=false --logging.tensorboard=false --run.dir=/tmp/g2
cp /tmp/g2/metrics.jsonl "$O/train_gpt2-metrics.jsonl" 2>/dev/null || true
TAIL=40 part plan_check 110 bash bench/gpu_plan_check.sh
TAIL=30 part serve_throughput 230 python bench/serve_throughput.py --num-prompts 256 --graphs on \
    --baseline hf --out "$O/serve_throughput-llama3-1b.json"
part kernel_choices 90 python bench/kernel_choices.py --ops rmsnorm,swiglu,loss,fp8 \
    --budget-s 25 --total-budget-s 75 --out "$O/kernel_choices.json"
echo "== done at $SECONDS s"
