"""What `trireme train`'s loop adds to a step: the real loop against the bench harness' bare step.

    python bench/train_overhead.py --preset gpt2-124m              # H200: about 3 minutes
    python bench/train_overhead.py --preset gpt2-124m --variant "fce-on:" \
        --variant "fce-off:model.fused_cross_entropy=false"
    python bench/train_overhead.py --smoke                          # CPU, tiny: that it runs

For each variant (a name and config overrides; default: the preset as `trireme train` runs it,
and the same with the chunked loss off, which is what bench/train_throughput.py measures unless
given --fused-cross-entropy) one trainer is built as `trireme train --data.mock=true` builds it
(trireme.training.build.build_trainer, with data), then:

- `loop`: trireme.training.loop.run_loop, the code `trireme train` runs (mock data read and
  checked per micro batch, logging every --log-interval steps with its host sync, the health
  checks, the metrics file), `--warmup` steps first (compilation), then `--steps` steps timed, then
  `--steps` more under torch.profiler;
- `step`: the harness' step on the same trainer (bench/train_throughput.py): random batches made
  on the device up front, `trainer.train_step` back to back, one sync at the end; timed, then
  profiled.

Per system it prints the step time (no profiler) and tokens/s, and from the profile, per step:
the GPU busy fraction (the union of the kernel, memcpy and memset intervals over the steps'
window, from the first step's data read to the end of the final sync); the host syncs
(cudaStreamSynchronize / cudaDeviceSynchronize / cudaEventSynchronize / blocking cudaMemcpy
calls, and aten::_local_scalar_dense: .item(), float(t), bool(t)) with the host time spent
waiting in them; the host time in cudaMemcpyAsync (a copy from pageable memory waits for the GPU
there, with no sync call); the host time reading data; the top CPU ops by self time and the top
kernels by device time. On the CPU (--smoke) `_local_scalar_dense` is no sync (torch's CPU AdamW
reads its step counts that way). The last table is each variant's `loop` against its `step`.
JSON goes to bench/results/train_overhead-<preset>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import io
import math
import sys
import tempfile
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (str(REPO), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

import train_throughput as tt  # noqa: E402
from profile_step import busy_time, device_records  # noqa: E402

from trireme.config import load_config  # noqa: E402
from trireme.training.build import build_trainer  # noqa: E402
from trireme.training.loop import run_loop  # noqa: E402

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
              "cudaMemcpy", "aten::_local_scalar_dense")
DEFAULT_VARIANTS = ["preset:", "fce-off:model.fused_cross_entropy=false"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2-124m")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:K=V[,K=V]",
                   help=f"config overrides (section.key=value, comma separated); default "
                   f"{DEFAULT_VARIANTS}")
    p.add_argument("--steps", type=int, default=3, help="timed steps, then as many profiled")
    p.add_argument("--warmup", type=int, default=3, help="loop steps first (compilation)")
    p.add_argument("--log-interval", type=int, default=5, help="the loop's train.log_interval")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="SECTION.KEY=V",
                   help="overrides for every variant, e.g. train.global_batch_size=128")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--seed", type=int, default=1234, help="seed of the step's random batches")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny: that the script runs")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        args.preset, args.steps, args.warmup, args.log_interval = "tiny", 2, 1, 1
        args.override = ["train.device=cpu", "model.vocab_size=256", "model.seq_length=32",
                         "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                         "model.num_attention_heads=4", "model.num_query_groups=2",
                         "train.micro_batch_size=2", "train.global_batch_size=4", *args.override]
        args.variant = args.variant or ["preset:"]
    args.variant = args.variant or list(DEFAULT_VARIANTS)
    if args.steps < 1 or args.warmup < 1:
        p.error("--steps and --warmup must be at least 1")
    return args


def variant_overrides(variant: str) -> tuple[str, list[str]]:
    name, _, rest = variant.partition(":")
    return name, [kv.strip() for kv in rest.split(",") if kv.strip()]


def build(args: argparse.Namespace, overrides: list[str], run_dir: Path):
    """The trainer `trireme train --config PRESET --data.mock=true ...` builds."""
    cfg = load_config(args.preset, [
        "data.mock=true", "train.eval_interval=0", "train.sample_tokens=0",
        "logging.progress=false", "logging.tensorboard=false", f"run.dir={run_dir}",
        f"train.log_interval={args.log_interval}", f"train.steps={args.warmup}",
        *args.override, *overrides])
    return build_trainer(cfg)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def annotate(trainer) -> None:
    """Mark each step's data read and step call in the profile (instance attributes)."""
    read, step = trainer.next_micro_batches, trainer.train_step

    def next_micro_batches():
        with torch.profiler.record_function("overhead.data"):
            return read()

    def train_step(batches, lr):
        with torch.profiler.record_function("overhead.step"):
            return step(batches, lr)

    trainer.next_micro_batches, trainer.train_step = next_micro_batches, train_step


def loop_steps(trainer, steps: int) -> None:
    """`steps` more steps of the real loop (its output kept off the report)."""
    trainer.cfg.train.steps = trainer.state.step + steps
    with contextlib.redirect_stdout(io.StringIO()):
        run_loop(trainer)


def harness_steps(trainer, batches: list, steps: int) -> None:
    """bench/train_throughput.py's step: pre-made device batches, one sync at the end."""
    lr = trainer.cfg.optimizer.lr
    for i in range(steps):
        with torch.profiler.record_function("overhead.step"):
            trainer.train_step(batches[i % len(batches)], lr)
    sync(trainer.device)


def profiled(run, device: torch.device):
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("overhead.window"):
            run()
            sync(device)
    return prof


def window(prof) -> tuple[float, float]:
    """(start, end) us: from the first data read or step to the end of the final sync."""
    marks = [e for e in prof.events() if e.name in ("overhead.data", "overhead.step")]
    whole = [e for e in prof.events() if e.name == "overhead.window"]
    start = min(e.time_range.start for e in marks)
    return start, max(e.time_range.end for e in whole)


def analyse(prof, steps: int, device: torch.device, top: int) -> dict:
    """Per-step numbers of a profile of `steps` steps (module docstring)."""
    start, end = window(prof)
    wall_us = end - start
    cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    syncs = [e for e in cpu if e.name in SYNC_CALLS and start <= e.time_range.start <= end]
    data_us = sum(e.time_range.end - e.time_range.start for e in cpu if e.name == "overhead.data")
    out = {"profiled_step_s": wall_us / 1e6 / steps, "data_read_s": data_us / 1e6 / steps,
           "syncs_per_step": {name: sum(e.name == name for e in syncs) / steps
                              for name in SYNC_CALLS},
           "sync_wait_s": sum(e.time_range.end - e.time_range.start for e in syncs
                              if e.name != "aten::_local_scalar_dense") / 1e6 / steps}
    out["syncs_per_step_total"] = sum(out["syncs_per_step"].values())
    # a copy from pageable host memory waits for the stream inside cudaMemcpyAsync: no sync call
    out["memcpy_async_s"] = sum(e.time_range.end - e.time_range.start for e in cpu
                                if e.name == "cudaMemcpyAsync"
                                and start <= e.time_range.start <= end) / 1e6 / steps
    out["top_cpu_ops"] = top_cpu_ops(cpu, start, end, steps, top)
    if device.type == "cuda":
        records = [r for r in device_records(prof) if r[1] + r[2] >= start and r[1] <= end]
        clipped = [(max(s, start), min(s + d, end)) for _, s, d in records]
        busy = busy_time(clipped)
        out.update(gpu_busy_fraction=busy / wall_us, gpu_busy_s=busy / 1e6 / steps,
                   kernels_per_step=len(records) / steps,
                   top_kernels=top_by_name([(n, d) for n, _, d in records], steps, top))
    return out


def top_cpu_ops(cpu: list, start: float, end: float, steps: int, top: int) -> list[dict]:
    """The CPU ops (aten ops, CUDA runtime calls, Python-level ranges) by self time."""
    rows = [(e.name, e.self_cpu_time_total) for e in cpu
            if start <= e.time_range.start <= end and not e.name.startswith("overhead.")]
    return top_by_name(rows, steps, top)


def top_by_name(rows: list[tuple[str, float]], steps: int, top: int) -> list[dict]:
    totals: dict[str, list] = {}
    for name, us in rows:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    ordered = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name[:200], "ms_per_step": us / 1e3 / steps, "calls_per_step": n / steps}
            for name, (us, n) in ordered]


def measure_variant(args: argparse.Namespace, name: str, overrides: list[str]) -> list[dict]:
    """The `loop` and `step` systems of one variant (module docstring)."""
    with tempfile.TemporaryDirectory() as tmp:
        trainer = build(args, overrides, Path(tmp) / "run")
        cfg, device = trainer.cfg, trainer.device
        loop_steps(trainer, args.warmup)  # compiles
        batches = tt.make_batches(cfg, device, args.seed, 2)
        harness_steps(trainer, batches, 1)  # the step's own first call
        tokens = cfg.train.global_batch_size * cfg.model.seq_length
        systems = {"loop": lambda: loop_steps(trainer, args.steps),
                   "step": lambda: harness_steps(trainer, batches, args.steps)}
        results = []
        for system, run in systems.items():
            sync(device)
            t0 = time.perf_counter()
            run()
            sync(device)
            step_s = (time.perf_counter() - t0) / args.steps
            if system == "loop":
                annotate(trainer)
            prof = profiled(run, device)
            if system == "loop":  # back to the class's methods
                del trainer.next_micro_batches, trainer.train_step
            results.append({"variant": name, "system": system, "overrides": overrides,
                            "step_s": step_s, "tokens_per_s": tokens / step_s,
                            **analyse(prof, args.steps, device, args.top)})
        settings = {"micro_batch_size": cfg.train.micro_batch_size,
                    "global_batch_size": cfg.train.global_batch_size,
                    "seq_length": cfg.model.seq_length, "compile": cfg.model.compile,
                    "fused_cross_entropy": cfg.model.fused_cross_entropy}
        for r in results:
            r["settings"] = settings
    return results


def free_memory() -> None:
    """Between variants: the last trainer's memory and compiled graphs go."""
    gc.collect()
    if torch.cuda.is_available():
        torch._dynamo.reset()
        torch.cuda.empty_cache()


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.1f}"


def report(results: list[dict], top: int) -> str:
    lines = ["| variant | system | step ms | tokens/s | GPU busy | kernels ms/step | syncs/step "
             "| sync wait ms/step | data read ms/step |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        busy = r.get("gpu_busy_fraction")
        lines.append(
            f"| {r['variant']} | {r['system']} | {fmt_ms(r['step_s'])} | "
            f"{r['tokens_per_s']:,.0f} | {'-' if busy is None else f'{100 * busy:.1f}%'} | "
            f"{fmt_ms(r.get('gpu_busy_s'))} | {r['syncs_per_step_total']:.1f} | "
            f"{fmt_ms(r['sync_wait_s'])} | {fmt_ms(r['data_read_s'])} |")
    for r in results:
        lines.append(f"\n{r['variant']} / {r['system']}: syncs per step "
                     + ", ".join(f"{k} {v:g}" for k, v in r["syncs_per_step"].items() if v)
                     + f"; host time in cudaMemcpyAsync {fmt_ms(r['memcpy_async_s'])} ms")
        lines.append(f"  top {top} CPU ops (self ms/step, calls/step):")
        lines += [f"    {o['ms_per_step']:9.2f} {o['calls_per_step']:8.1f}  {o['name'][:90]}"
                  for o in r["top_cpu_ops"]]
        if "top_kernels" in r:
            lines.append(f"  top {top} kernels (ms/step, calls/step):")
            lines += [f"    {k['ms_per_step']:9.2f} {k['calls_per_step']:8.1f}  {k['name'][:90]}"
                      for k in r["top_kernels"]]
    lines.append("\n| variant | loop step ms | harness step ms | loop overhead |\n"
                 "|---|---:|---:|---:|")
    for name in dict.fromkeys(r["variant"] for r in results):
        loop, step = (next(r for r in results if r["variant"] == name and r["system"] == s)
                      for s in ("loop", "step"))
        extra = loop["step_s"] / step["step_s"] - 1
        lines.append(f"| {name} | {fmt_ms(loop['step_s'])} | {fmt_ms(step['step_s'])} | "
                     f"{100 * extra:+.1f}% |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = []
    for variant in args.variant:
        name, overrides = variant_overrides(variant)
        print(f"train_overhead: {args.preset} {name} {overrides}", flush=True)
        results += measure_variant(args, name, overrides)
        free_memory()
    print(report(results, args.top))
    data = {**tt.run_header("train_overhead", torch.device(
        "cuda" if results and "gpu_busy_fraction" in results[0] else "cpu"), argv),
        "preset": args.preset, "steps": args.steps, "warmup": args.warmup,
        "log_interval": args.log_interval, "overrides": args.override, "results": results}
    out = Path(args.out or REPO / f"bench/results/train_overhead-{Path(args.preset).stem}.json")
    tt.write_json(out, data)
    print(f"wrote {out}")
    return 0 if all(math.isfinite(r["step_s"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
