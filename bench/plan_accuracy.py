"""How close `trireme plan` comes: predicted peak memory and step time against measured ones.

    python bench/plan_accuracy.py                     # GPU: 5 llama3-1b configurations
    python bench/plan_accuracy.py --smoke             # CPU: tiny ones (live tensor bytes)
    python bench/plan_accuracy.py --repredict bench/results/plan_accuracy-h200.json --gpu R.json
                                                      # no training: the recorded measurements
                                                      # against another rate table's predictions

`--override KEY=VALUE` applies to every configuration (e.g. model.compile=false for the eager
run, model.compile=true for the compiled one) and is recorded in the JSON ("override"), so
--repredict rebuilds the same configurations.

Each configuration is trained for --warmup + --steps steps on mock data (no files), on the GPU
each in a fresh process (--separate); measured: the peak of torch.cuda.max_memory_allocated over
the timed steps (the CPU smoke run: trireme.training.measure.LiveBytes) and the mean wall time of a
timed step (synchronized).
Predicted: trireme.plan.memory.estimate_memory and trireme.plan.time.estimate_time with the rate
table of --gpu. The goal (issue 20): memory within 10%, step time within 15%.
Prints a table and writes bench/results/plan_accuracy-<device>.json.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.config import load_config  # noqa: E402
from trireme.plan.enumerate import resolve  # noqa: E402
from trireme.plan.memory import GIB, estimate_memory, rank_params  # noqa: E402
from trireme.plan.rates import load_rates  # noqa: E402
from trireme.plan.time import estimate_time  # noqa: E402
from trireme.training.build import build_trainer  # noqa: E402
from trireme.training.measure import LiveBytes  # noqa: E402

GPU_CONFIGS = {
    "none-mb2": {"train.recompute": "none", "train.micro_batch_size": 2},
    "selective-mb4": {"train.recompute": "selective", "train.micro_batch_size": 4},
    "full-mb8": {"train.recompute": "full", "train.micro_batch_size": 8},
    "none-mb8": {"train.recompute": "none", "train.micro_batch_size": 8},
    "fp8-mb4": {"model.precision": "fp8", "train.micro_batch_size": 4},
}
# model.precision = "fp8" meant current scaling on the four block linears until fp8_scaling and
# fp8_layers defaulted to "auto" (delayed, the output layer too); files written before say
# nothing of either ("fp8_defaults" absent), so their fp8 rows are predicted with that recipe
FP8_BEFORE_AUTO = {"model.fp8_scaling": "current",
                   "model.fp8_layers": '["qkv", "out", "fc1", "fc2"]'}
SMOKE_CONFIGS = {
    "none-mb4": {"train.micro_batch_size": 4},
    "selective-mb2": {"train.recompute": "selective", "train.micro_batch_size": 2},
    "full-bf16": {"train.recompute": "full", "model.precision": "bf16"},
}
SMOKE = {"model.vocab_size": 1000, "train.global_batch_size": 8, "model.num_layers": 2,
         "model.seq_length": 64}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny CPU configurations")
    p.add_argument("--override", nargs="*", default=[], metavar="KEY=VALUE",
                   help="config overrides for every configuration, e.g. model.compile=false")
    p.add_argument("--preset", default=None, help="llama3-1b (GPU) / tiny (--smoke)")
    p.add_argument("--gpu", default=None, help="rate table (h200 on the GPU, cpu for --smoke)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--only", nargs="*", default=None, help="names of configurations to run")
    p.add_argument("--out", default=None)
    p.add_argument("--repredict", default=None, metavar="JSON",
                   help="predict the configurations of a results file again (with --gpu) and "
                        "compare with its measurements; nothing is trained")
    p.add_argument("--separate", action=argparse.BooleanOptionalAction, default=None,
                   help="each configuration in its own process (default on the GPU, so one "
                        "run's memory cannot count in the next one's peak)")
    return p.parse_args(argv)


def predict(cfg, rates) -> dict:
    cfg, layout = resolve(cfg, 1)
    mem = estimate_memory(cfg, layout, rates)
    t = estimate_time(cfg, layout, rates, 8, rank_params(cfg, layout, 0).total)
    return {"memory_gib": mem.total / GIB, "step_s": t.step_s,
            "memory_parts_gib": {k: v / GIB for k, v in mem.parts.items()},
            "time_parts_s": t.parts}


def overrides_of(text: list[str]) -> dict:
    """["key=value", ...] -> {key: value}."""
    return dict(o.split("=", 1) for o in text)


def as_recorded(overrides: dict, fp8_defaults: str | None) -> dict:
    """`overrides` of a recorded fp8 run with the fp8 recipe it ran (FP8_BEFORE_AUTO for a
    file written before the "auto" defaults: `fp8_defaults` None)."""
    if overrides.get("model.precision") != "fp8" or fp8_defaults is not None:
        return overrides
    return {**FP8_BEFORE_AUTO, **overrides}


def repredict(path: str, rates) -> list[dict]:
    """The rows of a results file with their predictions made again with `rates` (the
    measurements as recorded)."""
    data = json.loads(Path(path).read_text())
    rows = []
    for old in data["results"]:
        overrides = {"data.mock": True, **(SMOKE if data.get("smoke") else {}),
                     **old["overrides"], **overrides_of(data.get("override", []))}
        overrides = as_recorded(overrides, data.get("fp8_defaults"))
        want = predict(load_config(data["preset"], overrides), rates)
        got = old["measured"]
        rows.append({**old, "predicted": want,
                     "memory_error": want["memory_gib"] / got["memory_gib"] - 1,
                     "time_error": want["step_s"] / got["step_s"] - 1})
    return rows


def measure(cfg, warmup: int, steps: int) -> dict:
    """Peak memory (GiB) over the timed steps and their mean time (s)."""
    cuda = cfg.train.device != "cpu" and torch.cuda.is_available()
    mode = None if cuda else LiveBytes()
    if mode is not None:
        mode.__enter__()
    try:
        trainer = build_trainer(cfg)
        for _ in range(warmup):
            trainer.train_step(trainer.next_micro_batches(), 1e-4)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        else:
            mode.reset_peak()
        times = []
        for _ in range(steps):
            batches = trainer.next_micro_batches()
            start = time.perf_counter()
            out = trainer.train_step(batches, 1e-4)
            float(out["loss"])  # waits for the step
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if cuda else mode.peak
    finally:
        if mode is not None:
            mode.__exit__(None, None, None)
    del trainer
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return {"memory_gib": peak / GIB, "step_s": sum(times) / len(times), "step_times": times}


def main(argv=None) -> None:
    args = parse_args(argv)
    preset = args.preset or ("tiny" if args.smoke else "llama3-1b")
    rates = load_rates(args.gpu or ("cpu" if args.smoke else "h200"))
    if args.repredict:
        print(f"{args.repredict}: predicted with {args.gpu or 'h200'}")
        print_table(repredict(args.repredict, rates))
        return
    configs = SMOKE_CONFIGS if args.smoke else GPU_CONFIGS
    names = args.only or list(configs)
    run_dir = tempfile.mkdtemp()
    separate = args.separate if args.separate is not None else not args.smoke
    if separate and len(names) > 1:
        rows = [run_child(name, args, run_dir) for name in names]
        print_table(rows)
        write(rows, args, preset, rates.name)
        return
    rows = []
    for name in names:
        overrides = {"data.mock": True, "train.eval_interval": 0, "run.dir": run_dir,
                     **(SMOKE if args.smoke else {}), **configs[name],
                     **overrides_of(args.override)}
        if args.smoke:
            overrides["train.device"] = "cpu"
        cfg = load_config(preset, overrides)
        want = predict(cfg, rates)
        got = measure(cfg, args.warmup, args.steps)
        row = {"name": name, "overrides": configs[name], "predicted": want, "measured": got,
               "memory_error": want["memory_gib"] / got["memory_gib"] - 1,
               "time_error": want["step_s"] / got["step_s"] - 1}
        rows.append(row)
        print(f"{name:<16} memory {want['memory_gib']:8.3f} / {got['memory_gib']:8.3f} GiB "
              f"({100 * row['memory_error']:+5.1f}%)   step {want['step_s']:7.3f} / "
              f"{got['step_s']:7.3f} s ({100 * row['time_error']:+5.1f}%)", flush=True)
    print_table(rows)
    write(rows, args, preset, rates.name)


def run_child(name: str, args, run_dir: str) -> dict:
    """One configuration in a fresh process (its JSON read back)."""
    out = Path(run_dir) / f"{name}.json"
    cmd = [sys.executable, __file__, "--only", name, "--warmup", str(args.warmup), "--steps",
           str(args.steps), "--out", str(out), "--no-separate"]
    for flag, value in (("--preset", args.preset), ("--gpu", args.gpu)):
        if value:
            cmd += [flag, value]
    if args.smoke:
        cmd.append("--smoke")
    if args.override:
        cmd += ["--override", *args.override]
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())["results"][0]


def print_table(rows: list[dict]) -> None:
    print("\n| config | predicted GiB | measured GiB | error | predicted step s | measured step s "
          "| error |\n|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p, m = r["predicted"], r["measured"]
        print(f"| {r['name']} | {p['memory_gib']:.2f} | {m['memory_gib']:.2f} | "
              f"{100 * r['memory_error']:+.1f}% | {p['step_s']:.3f} | {m['step_s']:.3f} | "
              f"{100 * r['time_error']:+.1f}% |")


def write(rows: list[dict], args, preset: str, rates_name: str) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke \
        else "cpu"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                capture_output=True, text=True).stdout.strip()
    except OSError:
        commit = ""
    out = Path(args.out or REPO / "bench" / "results" / (
        f"plan_accuracy-{'smoke' if args.smoke else rates_name}.json"))
    out.parent.mkdir(parents=True, exist_ok=True)
    data = {"date": datetime.datetime.now(datetime.UTC).isoformat(), "device": device,
            "torch": torch.__version__, "git_commit": commit, "preset": preset,
            "rates": rates_name, "smoke": args.smoke, "override": args.override,
            "fp8_defaults": "auto",
            "warmup": args.warmup, "steps": args.steps, "results": rows}
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
