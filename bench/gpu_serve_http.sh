#!/bin/bash
# bench/serve_http.py on one GPU in one device call (< 10 min): this tree's `trireme serve`
# against the engine alone at concurrency 1 / 64 / 256, streamed and whole; then, if BASE names
# another checkout (its trireme; this tree's bench scripts are copied into it), that server over
# the same checkpoint, HTTP only. JSON and logs under $OUT (default bench/results).
#   bash bench/gpu_serve_http.sh                    # REPEATS=3 BUDGET_S=420 for the record
#   BASE=/path/to/old/checkout bash bench/gpu_serve_http.sh
#   EXTRA="--engine plain" adds flags to this tree's run
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results}
WORK=${WORK:-/tmp/serve_http_work}
REPEATS=${REPEATS:-1}
BUDGET_S=${BUDGET_S:-0}
LEVELS=${LEVELS:-1,64,256}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$WORK"
timeout ${NEW_TIMEOUT_S:-480} python3 bench/serve_http.py --workdir "$WORK" --repeats "$REPEATS" \
    --budget-s "$BUDGET_S" --concurrency "$LEVELS" --out "$OUT/serve_http-new.json" ${EXTRA:-} \
    2>&1 | tee "$OUT/serve_http-new.log"
cp "$WORK/serve_http.log" "$OUT/serve_http-new-server.log" 2>/dev/null
if [ -n "${BASE:-}" ]; then
    cp bench/serve_http.py bench/serve_throughput.py "$BASE/bench/"
    : > "$WORK/serve_http.log"
    timeout ${BASE_TIMEOUT_S:-240} python3 "$BASE/bench/serve_http.py" --workdir "$WORK" \
        --engine off --concurrency "${BASE_LEVELS:-$LEVELS}" --out "$OUT/serve_http-base.json" \
        2>&1 | tee "$OUT/serve_http-base.log"
    cp "$WORK/serve_http.log" "$OUT/serve_http-base-server.log" 2>/dev/null
fi
