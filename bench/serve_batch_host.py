"""The host cost of building one decode step's inputs (Engine._batch), on the CPU.

    python bench/serve_batch_host.py                  # 64 requests, 640 cached tokens each
    python bench/serve_batch_host.py --batch 1,16,64,256 --context 640

B requests that have their prompts cached (context tokens each) are put straight into a small
engine's running set (no forward), then the step's tensors are built --reps times; the median
time per build is reported, in microseconds. The model is tiny (the inputs do not depend on its
width): this measures only the Python and copy work per step. Prints a table; writes JSON
(default bench/results/serve_batch_host.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from trireme.config import ModelConfig  # noqa: E402
from trireme.models.gpt import GPT  # noqa: E402
from trireme.serving.engine import Engine, EngineSettings  # noqa: E402
from trireme.serving.sampling import SamplingParams  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,64")
    p.add_argument("--context", type=int, default=640)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def decoding_engine(batch: int, context: int, block_size: int) -> Engine:
    """An engine whose `batch` running requests have `context` tokens cached (state set by hand)."""
    seq = context + 64
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=2, ffn_hidden_size=64,
                      vocab_size=128, seq_length=seq, position_embedding="rope",
                      normalization="rmsnorm", activation="swiglu")
    blocks = batch * -(-seq // block_size) + 1
    engine = Engine(GPT(cfg, seed=0), EngineSettings(block_size=block_size, num_blocks=blocks,
                                                     max_running=batch, max_queue=batch))
    gen = torch.Generator().manual_seed(0)
    for _ in range(batch):
        prompt = torch.randint(0, 128, (context,), generator=gen).tolist()
        engine.submit(prompt, SamplingParams(max_tokens=32, greedy=True))
    engine.scheduler.admit()
    for r in engine.scheduler.running:
        r.num_cached, r.output_ids = context, [1]
    return engine


def time_batch(engine: Engine, reps: int) -> float:
    plan = engine.scheduler.plan()
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            t = time.perf_counter()
            engine._batch(plan)
            times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for batch in (int(b) for b in args.batch.split(",")):
        engine = decoding_engine(batch, args.context, args.block_size)
        rows.append({"batch": batch, "context": args.context,
                     "batch_us": time_batch(engine, args.reps)})
        print(f"batch {batch:>4}  context {args.context}: "
              f"Engine._batch {rows[-1]['batch_us']:.1f} us")
    out = Path(args.out or HERE / "results" / "serve_batch_host.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps({"torch": torch.__version__, "results": rows}, indent=1) + "\n")
    tmp.replace(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
