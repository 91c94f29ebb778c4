# Sourced by the one-call GPU scripts (bench/gpu_session*.sh): `part NAME SECONDS CMD...` runs CMD
# under min(SECONDS, what is left of $TOTAL), logs to $O/NAME.log and prints its tail; a part not
# named in $PARTS (comma-separated; unset: every part) is skipped, and so is one with under 30 s left.
# Sourcing it also exports O and PYTHONUNBUFFERED and prints the GPU's name; `train` and `step` are
# parts every session uses (`trireme train` as shipped; the serving decode step at batch 64).
O=${OUT:-bench/results}
export O PYTHONUNBUFFERED=1  # the part functions (train) see $O; logs arrive as written
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader 2>/dev/null || true

part() {
    local name=$1 limit=$2; shift 2
    if [ -n "${PARTS:-}" ]; then case ",$PARTS," in *",$name,"*) ;; *) return ;; esac; fi
    local left=$((${TOTAL:-560} - SECONDS))
    if [ "$left" -lt 30 ]; then echo "== $name: skipped ($left s left)"; return; fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s, at $SECONDS s)"
    if declare -F "$1" >/dev/null; then export -f "$1"; set -- bash -c '"$@"' _ "$@"; fi
    timeout "$limit" "$@" 2>&1 | grep -v USDT | tee "$O/$name.log" | tail -"${TAIL:-30}"
}

train() {  # NAME PRESET OVERRIDES...: `trireme train` as shipped, 15 steps; its metrics to $O
    local name=$1 preset=$2; shift 2
    python -m trireme train --config "$preset" --data.mock=true --train.steps=15 \
        --train.log_interval=3 --train.eval_interval=0 --train.sample_tokens=0 \
        --logging.progress=false --logging.tensorboard=false --run.dir="/tmp/$name" "$@" \
        && cp "/tmp/$name/metrics.jsonl" "$O/train-$name-metrics.jsonl"
}

step() {  # NAME [VAR=VALUE...]: the decode step at batch 64 (a short serving run first)
    local name=$1; shift
    TAIL=4 part "$name" 80 env "$@" python bench/serve_throughput.py --graphs on \
        --concurrency 16 --num-prompts 32 --output-tokens 64 --bound-batches 64 \
        --out "$O/$name.json"
}
