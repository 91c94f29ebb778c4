"""Loss parity: train variants of one preset on the same real text and compare their loss curves.

    python bench/loss_parity.py --preset llama3-1b --steps 300 \\
        --override model.seq_length=1024 train.global_batch_size=8 \\
        --variant ref:model.attention_backend=math --variant fast:model.compile=true
    python bench/loss_parity.py --preset tiny --device cpu --steps 20 \\
        --variant ref:model.attention_backend=reference --variant sdpa:model.attention_backend=math

Each variant is the preset plus the common `--override`s plus its own overrides
(`--variant NAME:section.key=value,section.key=value`), trained for `--steps` optimizer steps with
trireme's own pieces (build_trainer with data, Trainer.next_micro_batches, Trainer.train_step, the
configured LR schedule) in this process, one variant after another (the previous one's model and
optimizer freed first). Every variant starts from the same initial weights (train.seed) and reads
the same batches in the same order, so the curves differ only by numerics.

Data: the config's data.path, or by default the embedded corpus (the Python standard library's
sources, BPE vocabulary data.embedded_vocab_size = 4096, built and cached on first use): its token
ids fit any preset's vocabulary (llama3-1b keeps its 128,256-entry embedding; set
model.vocab_size=0 to size the model to the tokenizer instead).

Reported per variant: the loss of every step, the final loss (mean of the last `--last` steps), the
validation loss at the end (train.eval_steps micro batches), the relative difference of the final
loss from the first variant's, and pass / fail against `--threshold` (default 1%). A schedule whose
warmup is longer than half the run (llama3-1b: 2,000 steps) is shortened to a tenth of the run, so
the run learns; the JSON records the schedule used. Writes bench/results/loss_parity-<tag>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import re
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (str(REPO), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

import train_throughput as tt  # noqa: E402

from trireme.config import Config, load_config  # noqa: E402


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'name:section.key=v,section.key=v' -> (name, ['section.key=v', ...]); 'name' or 'name:'
    alone is the preset with the common overrides only. A comma inside [...] belongs to a list
    value (section.key=[a,b])."""
    name, _, rest = text.partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"--variant {text!r}: give it a name, as NAME:section.key=value,...")
    overrides = [item.strip() for item in re.split(r",(?![^\[]*\])", rest) if item.strip()]
    for item in overrides:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ValueError(f"--variant {text!r}: {item!r} is not section.key=value")
    return name, overrides


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b", help="preset name or .toml path")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:SECTION.KEY=V,...",
                   help="a variant (repeat; at least two); the first is the reference")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="SECTION.KEY=V",
                   help="overrides common to all variants, e.g. model.seq_length=1024")
    p.add_argument("--steps", type=int, default=300, help="optimizer steps per variant")
    p.add_argument("--last", type=int, default=10, help="final loss = mean of the last N steps")
    p.add_argument("--threshold", type=float, default=0.01,
                   help="largest allowed |relative difference| of the final loss (0.01 = 1%%)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--tag", default=None, help="JSON name: loss_parity-<tag>.json (default: the "
                   "preset and variant names)")
    p.add_argument("--out", default=None, help="JSON path (overrides --tag); a copy goes to $OUT "
                   "when that variable is set")
    args = p.parse_args(argv)
    if args.steps < 1 or not 1 <= args.last <= args.steps:
        p.error("--steps must be at least 1 and --last between 1 and --steps")
    try:
        args.variants = [parse_variant(v) for v in args.variant]
    except ValueError as e:
        p.error(str(e))
    names = [name for name, _ in args.variants]
    if len(names) < 2 or len(set(names)) != len(names):
        p.error("give at least two --variant, with distinct names")
    return args


def variant_config(args: argparse.Namespace, overrides: list[str]) -> tuple[Config, list[str]]:
    every = [f"train.device={args.device}", f"train.steps={args.steps}", *args.override,
             *overrides]
    cfg = load_config(args.preset, every)
    if cfg.train.micro_batch_size == 0:  # derived (one process: the whole global batch)
        cfg.train.micro_batch_size = cfg.train.global_batch_size
    sched = cfg.schedule
    if sched.warmup_steps > args.steps // 2:  # e.g. llama3-1b's 2,000: the run would not learn
        sched.warmup_steps = max(args.steps // 10, 1)
    return cfg, every


def train_variant(name: str, cfg: Config) -> dict:
    """Train `cfg` for cfg.train.steps steps; the loss of each step and the end's eval loss."""
    from trireme.optim.schedules import lr_at
    from trireme.training.build import build_trainer

    device = tt.pick_device(cfg.train.device)
    tt.reset_memory(device)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, with_data=True)
    tt.sync(device)
    build_s = time.perf_counter() - t0
    losses, grad_norms = [], []
    t0 = time.perf_counter()
    for _ in range(cfg.train.steps):
        lr = lr_at(trainer.state.step, cfg.optimizer, cfg.schedule, cfg.train.steps)
        result = trainer.train_step(trainer.next_micro_batches(), lr)
        losses.append(result["loss"].detach())  # read back at the end: no sync per step
        grad_norms.append(result["grad_norm"].detach())
        trainer.state.step += 1
        trainer.state.consumed_samples += cfg.train.global_batch_size
    tt.sync(device)
    train_s = time.perf_counter() - t0
    eval_loss = trainer.evaluate() if trainer.valid_data is not None else None
    out = {
        "variant": name,
        "losses": [float(v) for v in torch.stack(losses).float().cpu()],
        "grad_norms": [float(v) for v in torch.stack(grad_norms).float().cpu()],
        "eval_loss": eval_loss,
        "build_s": build_s,
        "train_s": train_s,
        "tokens_per_s": cfg.train.steps * cfg.train.global_batch_size * cfg.model.seq_length
        / train_s,
        "peak_mem_gib": (torch.cuda.max_memory_allocated(device) / 2**30
                         if device.type == "cuda" else None),
        "data_path": cfg.data.path,
        "vocab_size": cfg.model.vocab_size,
    }
    return out


def compare(results: list[dict], last: int, threshold: float) -> None:
    """Adds final_loss, rel_diff (vs the first variant) and passed to each result."""
    for r in results:
        r["final_loss"] = sum(r["losses"][-last:]) / last
    ref = results[0]
    for r in results:
        r["rel_diff"] = (r["final_loss"] - ref["final_loss"]) / ref["final_loss"]
        r["first_loss_diff"] = r["losses"][0] - ref["losses"][0]
        # largest gap between the curves, each smoothed over `last` steps
        r["max_smoothed_rel_diff"] = max(
            abs(a - b) / abs(b) for a, b in zip(smooth(r["losses"], last),
                                                smooth(ref["losses"], last))
        )
        if r.get("eval_loss") is not None and ref.get("eval_loss") is not None:
            r["eval_rel_diff"] = (r["eval_loss"] - ref["eval_loss"]) / ref["eval_loss"]
        finite = all(math.isfinite(v) for v in r["losses"])
        r["passed"] = finite and abs(r["rel_diff"]) <= threshold


def smooth(values: list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (shorter at the start)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def format_table(results: list[dict], last: int) -> str:
    header = (f"{'variant':<16}{'first':>9}{f'last {last}':>10}{'eval':>9}{'vs ref':>9}"
              f"{'max gap':>9}{'tok/s':>10}{'':>7}")
    lines = [header, "-" * len(header)]
    for r in results:
        if "error" in r:
            lines.append(f"{r['variant']:<16}  FAILED: {r['error'].splitlines()[-1][:80]}")
            continue
        ev = f"{r['eval_loss']:.4f}" if r.get("eval_loss") is not None else "-"
        lines.append(f"{r['variant']:<16}{r['losses'][0]:>9.4f}{r['final_loss']:>10.4f}{ev:>9}"
                     f"{100 * r['rel_diff']:>8.2f}%{100 * r['max_smoothed_rel_diff']:>8.2f}%"
                     f"{r['tokens_per_s']:>10,.0f}{'PASS' if r['passed'] else 'FAIL':>7}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results, settings = [], []
    for name, overrides in args.variants:
        cfg, every = variant_config(args, overrides)
        device = tt.pick_device(cfg.train.device)
        print(f"loss_parity: {name}: {args.preset} + {' '.join(every)} "
              f"(warmup {cfg.schedule.warmup_steps})", flush=True)
        settings.append({"variant": name, "overrides": every,
                         "schedule": dataclasses.asdict(cfg.schedule),
                         "micro_batch_size": cfg.train.micro_batch_size,
                         "global_batch_size": cfg.train.global_batch_size,
                         "seq_length": cfg.model.seq_length, "seed": cfg.train.seed,
                         "compile": cfg.model.compile,
                         "attention_backend": cfg.model.attention_backend,
                         "precision": cfg.model.precision})
        try:
            r = train_variant(name, cfg)
        except Exception as e:  # report it and go on
            import traceback

            traceback.print_exc()
            r = {"variant": name, "error": f"{type(e).__name__}: {e}"}
        else:
            print(f"  {name}: loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f} in "
                  f"{r['train_s']:.1f} s ({r['tokens_per_s']:,.0f} tokens/s)", flush=True)
        results.append(r)
        gc.collect()
        if cfg.model.compile:
            torch._dynamo.reset()
        tt.reset_memory(device)
    ok = [r for r in results if "error" not in r]
    if len(ok) == len(results):
        compare(results, args.last, args.threshold)
        print(format_table(results, args.last))
    passed = len(ok) == len(results) and all(r["passed"] for r in results)
    print(f"loss parity {'PASSED' if passed else 'FAILED'} (threshold {100 * args.threshold:g}% "
          f"on the mean loss of the last {args.last} steps, vs {results[0]['variant']})")
    data = {
        **tt.run_header("loss_parity", device, argv),
        "preset": args.preset, "steps": args.steps, "last": args.last,
        "threshold": args.threshold, "passed": passed,
        "variants": settings, "results": results,
    }
    tag = args.tag or "-".join([Path(args.preset).stem, *(n for n, _ in args.variants)])
    out = Path(args.out or REPO / "bench" / "results" / f"loss_parity-{tag}.json")
    tt.write_json(out, data)
    print(f"wrote {out}")
    if os.environ.get("OUT"):
        tt.write_json(Path(os.environ["OUT"]) / out.name, data)
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
