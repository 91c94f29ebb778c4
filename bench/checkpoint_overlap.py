"""How much an asynchronous sharded checkpoint slows the training steps it overlaps.

    python bench/checkpoint_overlap.py --preset llama3-1b            # one GPU, bf16
    python bench/checkpoint_overlap.py --preset tiny --device cpu --steps 3 --warmup 1  # smoke

The trainer is built as in bench/train_throughput.py (random token batches, no data). After
`--warmup` untimed steps, three phases of `--steps` timed steps each:

- none: no checkpoint (the baseline step time);
- async: `checkpoint.async_save = true`; the save starts right before the first timed step (the
  foreground part, copying the state to CPU, counts into that step), the background thread writes
  while the steps go on;
- blocking: a blocking sharded save, then the steps (the save's time is what the run stands
  still).

Reported per phase: median and max step time, the save's foreground time and its wall time until
the checkpoint is complete on disk (latest moved), and max step / baseline median. A table is
printed and JSON written to bench/results/checkpoint_overlap-<preset>.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_throughput as tt  # noqa: E402

from trireme.checkpoint.saver import Saver  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b", help="preset name or .toml path")
    p.add_argument("--steps", type=int, default=8, help="timed steps per phase")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dir", default=None, help="checkpoint root (default: a temporary directory, "
                   "removed at the end)")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="SECTION.KEY=V")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--out", default=None, help="JSON path")
    args = p.parse_args(argv)
    # the fields train_throughput.build_config reads
    args.micro_batch_size = args.global_batch_size = args.seq_length = None
    args.compile = False
    return args


def timed_steps(trainer, batches, first: int, n: int, before_first=None) -> list[float]:
    """Seconds of each of `n` steps (CUDA events on the GPU); `before_first()` runs inside the
    first step's timing."""
    device, lr = trainer.device, trainer.cfg.optimizer.lr
    times = []
    for i in range(n):
        tt.sync(device)
        t0 = time.perf_counter()
        if i == 0 and before_first is not None:
            before_first()
        trainer.train_step(batches[first + i], lr)
        trainer.state.step += 1
        tt.sync(device)
        times.append(time.perf_counter() - t0)
    return times


def phase(name: str, times: list[float], baseline: float | None, save_fg: float | None = None,
          save_wall: float | None = None) -> dict:
    median = statistics.median(times)
    return {"phase": name, "step_s_median": median, "step_s_max": max(times), "step_times": times,
            "save_foreground_s": save_fg, "save_wall_s": save_wall,
            "max_step_vs_baseline": max(times) / baseline if baseline else 1.0}


def format_table(rows: list[dict]) -> str:
    head = (f"{'phase':<10}{'median step s':>15}{'max step s':>12}{'save fg s':>11}"
            f"{'save wall s':>13}{'max/base':>10}")
    lines = [head, "-" * len(head)]
    for r in rows:
        fg = f"{r['save_foreground_s']:.3f}" if r["save_foreground_s"] is not None else "-"
        wall = f"{r['save_wall_s']:.3f}" if r["save_wall_s"] is not None else "-"
        lines.append(f"{r['phase']:<10}{r['step_s_median']:>15.4f}{r['step_s_max']:>12.4f}"
                     f"{fg:>11}{wall:>13}{r['max_step_vs_baseline']:>9.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="trireme-ckpt-bench-"))
    args.override = [f"checkpoint.dir={root}", "checkpoint.format=sharded",
                     "checkpoint.keep_last=1", *args.override]
    cfg, overrides = tt.build_config(args)
    from trireme.training.build import build_trainer

    trainer = build_trainer(cfg, with_data=False)
    device = trainer.device
    n, w = args.steps, args.warmup
    batches = tt.make_batches(cfg, device, args.seed, w + 3 * n)
    print(f"checkpoint_overlap: {args.preset} on {tt.device_name(device)}, "
          f"{sum(p.numel() for p in trainer.model.parameters()) / 1e6:,.1f}M parameters, "
          f"{cfg.model.precision}, {w} warmup + 3 x {n} steps, checkpoints in {root}", flush=True)
    try:
        timed_steps(trainer, batches, 0, w)
        base = timed_steps(trainer, batches, w, n)
        baseline = statistics.median(base)
        rows = [phase("none", base, baseline)]

        cfg.checkpoint.async_save = True
        saver = Saver(trainer.checkpointed(), save_gathered=None)
        fg = {}

        def start_save():
            t0 = time.perf_counter()
            saver.save()
            fg["t0"], fg["fg"] = t0, time.perf_counter() - t0

        times = timed_steps(trainer, batches, w + n, n, start_save)
        saver.wait()
        wall = saver.finished_at - fg["t0"]
        rows.append(phase("async", times, baseline, fg["fg"], wall))

        cfg.checkpoint.async_save = False
        t0 = time.perf_counter()
        saver.save()
        blocking = time.perf_counter() - t0
        times = timed_steps(trainer, batches, w + 2 * n, n)
        times[0] += blocking  # the run stood still for the save before this step
        rows.append(phase("blocking", times, baseline, blocking, blocking))
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    print(format_table(rows))
    data = {
        **tt.run_header("checkpoint_overlap", device, argv),
        "settings": {"preset": args.preset, "precision": cfg.model.precision,
                     "warmup_steps": w, "timed_steps": n, "overrides": overrides},
        "results": rows,
    }
    out = Path(args.out or REPO / "bench" / "results" /
               f"checkpoint_overlap-{Path(args.preset).stem}.json")
    tt.write_json(out, data)
    print(f"wrote {out}")
    if os.environ.get("OUT"):
        tt.write_json(Path(os.environ["OUT"]) / out.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
