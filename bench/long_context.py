"""The longest sequence llama3-1b trains at on one GPU with full recomputation: `trireme train` at
micro batch 1 for each sequence length, a few steps each, reading the peak memory (CUDA's
max_memory_allocated, the run's `mem_gib`) and tokens/s from the run's metrics.jsonl.

    python bench/long_context.py                          # 8k .. 256k on the GPU
    python bench/long_context.py --seqs 8192 16384 --steps 2
    python bench/long_context.py --smoke                  # CPU, the tiny preset: that it runs

A length that runs out of memory is reported as such (the command's exit status and its last
line) and the sweep goes on. Prints a table; writes bench/results/long_context.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--seqs", type=int, nargs="+",
                   default=[8192, 16384, 32768, 65536, 131072, 262144])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--recompute", default="full")
    p.add_argument("--timeout", type=int, default=400, help="seconds per length")
    p.add_argument("--extra", nargs="*", default=[], help="more --section.key=value overrides")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=str(REPO / "bench/results/long_context.json"))
    return p.parse_args(argv)


def run_one(args, seq: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "trireme", "train", "--config", args.preset,
           "--data.mock=true", f"--model.seq_length={seq}", "--train.micro_batch_size=1",
           "--train.global_batch_size=1", f"--train.steps={args.steps}",
           "--train.log_interval=1", "--train.eval_interval=0", "--train.sample_tokens=0",
           f"--train.recompute={args.recompute}", "--logging.progress=false",
           "--logging.tensorboard=false", f"--run.dir={run_dir}", *args.extra]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"seq": seq, "ok": False, "why": f"over {args.timeout} s"}
    metrics = run_dir / "metrics.jsonl"
    if done.returncode != 0 or not metrics.exists():
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
        return {"seq": seq, "ok": False, "why": last[0][:200]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    last = rows[-1]
    return {"seq": seq, "ok": True, "mem_gib": max(r["mem_gib"] for r in rows),
            "tokens_per_s": last["tokens_per_s"], "mfu": last.get("mfu"),
            "loss": last["loss"]}


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.smoke:
        args.preset, args.seqs, args.steps = "tiny", [64, 128], 2
        args.extra = [*args.extra, "--model.vocab_size=512"]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seq in args.seqs:
            row = run_one(args, seq, Path(tmp) / f"seq{seq}")
            results.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{args.preset}, micro batch 1, recompute={args.recompute}\n")
    print("| sequence | peak GiB | tokens/s | MFU |\n|---:|---:|---:|---:|")
    for r in results:
        if r["ok"]:
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
            print(f"| {r['seq']:,} | {r['mem_gib']:.1f} | {r['tokens_per_s']:,.0f} | {mfu} |")
        else:
            print(f"| {r['seq']:,} | failed: {r['why']} | | |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"preset": args.preset, "recompute": args.recompute,
                                          "rows": results}, indent=1))


if __name__ == "__main__":
    main()
