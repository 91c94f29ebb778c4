"""Throughput of several systems, each measured in fresh processes, alternated, >= 3 repeats: the
honest comparison (one process measuring two systems lets the first warm or fragment the GPU for
the second: the same HF baseline measured a third slower that way; bench/RESULTS.md).

    python bench/fresh_compare.py --preset llama3-1b --repeats 3 \\
        --system "train" --system "hf:--compile-hf --hf-tf32"
    python bench/fresh_compare.py --preset tiny --smoke          # CPU: that it runs

A system is `KIND[:EXTRA ARGS]`:
- `train`: `trireme train --config PRESET --data.mock=true` as a user runs it (the preset's
  defaults: on a GPU compiled, the chunked loss), for `--steps` steps; its tokens/s is the
  median of the logged values after the first log (the first includes compilation). EXTRA are
  `--section.key=value` overrides.
- `trireme`: bench/train_throughput.py's trireme system alone (EXTRA: that script's flags).
- `hf`: bench/train_throughput.py's Hugging Face baseline alone (`--skip-trireme --compare hf`,
  EXTRA: e.g. `--compile-hf --hf-tf32`).

Round r runs every system once, in the order given; each system's median and spread (max - min)
over the rounds is reported, and every system's ratio to the last one. Prints a table; writes
bench/results/fresh_compare-<preset>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="llama3-1b")
    p.add_argument("--system", action="append", default=[], metavar="KIND[:ARGS]")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30, help="train: optimizer steps per run")
    p.add_argument("--log-interval", type=int, default=5)
    p.add_argument("--timeout", type=int, default=900, help="seconds per run")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: that the script runs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.repeats, args.steps, args.log_interval = "tiny", 2, 4, 1
        args.system = args.system or ["train:--model.vocab_size=512",
                                      "trireme:--device cpu --steps 1 --warmup 1"]
    if not args.system:
        p.error("give at least one --system")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def _split(system: str) -> tuple[str, list[str]]:
    kind, _, extra = system.partition(":")
    if kind not in ("train", "trireme", "hf"):
        raise SystemExit(f"--system {system!r}: the kind must be train, trireme or hf")
    return kind, shlex.split(extra)


def _run(cmd: list[str], timeout: int) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    env.pop("OUT", None)  # train_throughput copies its JSON to $OUT: not wanted here
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def run_train(args, extra: list[str], tmp: Path) -> float:
    """tokens/s of one `trireme train` run: the median of its logged values after the first."""
    run_dir = tmp / "run"
    cmd = [sys.executable, "-m", "trireme", "train", "--config", args.preset, "--data.mock=true",
           f"--train.steps={args.steps}", f"--train.log_interval={args.log_interval}",
           "--train.eval_interval=0", "--train.sample_tokens=0", "--logging.progress=false",
           "--logging.tensorboard=false", f"--run.dir={run_dir}", *extra]
    done = _run(cmd, args.timeout)
    metrics = run_dir / "metrics.jsonl"
    if done.returncode or not metrics.exists():
        raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1:])
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in rows[1:]] or [rows[-1]["tokens_per_s"]]
    return statistics.median(rates)


def run_harness(args, kind: str, extra: list[str], tmp: Path) -> float:
    """tokens/s of one system of bench/train_throughput.py, alone in its process."""
    out = tmp / "harness.json"
    cmd = [sys.executable, str(REPO / "bench/train_throughput.py"), "--preset", args.preset,
           "--out", str(out), *extra]
    if kind == "hf":
        cmd += ["--skip-trireme", "--compare", "hf"]
    done = _run(cmd, args.timeout)
    if done.returncode or not out.exists():
        raise RuntimeError((done.stderr or done.stdout).strip().splitlines()[-1:])
    results = [r for r in json.loads(out.read_text())["results"] if "error" not in r]
    return results[0]["tokens_per_s"]


def main(argv=None) -> None:
    args = parse_args(argv)
    systems = [_split(s) for s in args.system]
    runs: dict[str, list[float]] = {s: [] for s in args.system}
    for round_ in range(args.repeats):
        for name, (kind, extra) in zip(args.system, systems):
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    rate = (run_train(args, extra, Path(tmp)) if kind == "train"
                            else run_harness(args, kind, extra, Path(tmp)))
            except (RuntimeError, subprocess.TimeoutExpired) as e:  # one failed run: go on
                print(f"round {round_ + 1}: {name}: failed: {e}", flush=True)
                continue
            runs[name].append(rate)
            print(f"round {round_ + 1}: {name}: {rate:,.0f} tokens/s", flush=True)
    runs = {name: rates for name, rates in runs.items() if rates}
    if not runs:
        raise SystemExit("every run failed")
    medians = {name: statistics.median(rates) for name, rates in runs.items()}
    last = list(runs)[-1]
    print(f"\n{args.preset}, {args.repeats} fresh processes per system, alternated\n")
    print(f"| system | runs (tokens/s) | median | spread | vs {last} |\n|---|---|---:|---:|---:|")
    for name, rates in runs.items():
        print(f"| {name} | {' / '.join(f'{r:,.0f}' for r in rates)} | {medians[name]:,.0f} | "
              f"{max(rates) - min(rates):,.0f} | {medians[name] / medians[last]:.2f}x |")
    out = Path(args.out or REPO / f"bench/results/fresh_compare-{Path(args.preset).stem}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"preset": args.preset, "repeats": args.repeats,
                               "runs": runs, "medians": medians}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
