#!/usr/bin/env bash
# Checks for a GPU machine: the CUDA paths of the test suite, an end-to-end run of the
# main job on the GPU, and the llama3-1b throughput against Hugging Face. Logs go to $OUT.
# Deliberately not run here (each is run on purpose; see bench/README.md):
# train_throughput.py --dp-path, profile_step.py, loss_parity.py.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD TRIREME_COMMIT=${TRIREME_COMMIT:-unknown}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cudnn', torch.backends.cudnn.version())"
# 1. unit tests that have CUDA paths (attention backends, model, generation, optimizer)
python3 -m pytest -q -x tests/test_attention.py tests/test_model.py tests/test_generate.py \
    tests/test_optimizer.py 2>&1 | tail -5 | tee "$OUT/pytest.txt"
# 2. the main job on the GPU, bf16
python3 -m trireme train --model.precision=bf16 --run.dir=/tmp/gpu-tiny --logging.progress=false \
    2>&1 | tail -25 | tee "$OUT/tiny.txt"
# 3. throughput: llama3-1b eager vs HF eager, then compiled
python3 bench/train_throughput.py --preset llama3-1b --compare hf --steps 6 --warmup 3 \
    --out "$OUT/train_throughput-llama3-1b.json" 2>&1 | tail -8
python3 bench/train_throughput.py --preset llama3-1b --compile --steps 6 --warmup 3 \
    --out "$OUT/train_throughput-llama3-1b-compile.json" 2>&1 | tail -8
