"""Where a training step's GPU time goes: kernels by category, busy vs idle, the top kernels.

    python bench/profile_step.py --preset llama3-1b
    python bench/profile_step.py --preset llama3-1b --compile --trace /tmp/llama3-1b.trace.json
    python bench/profile_step.py --preset tiny --device cpu --steps 1 --warmup 1

Builds the trainer as bench/train_throughput.py does (random token batches made on the device up
front, no data files), runs `--warmup` untimed steps (compiling happens there), then `--steps` steps
timed with CUDA events and no profiler, then `--steps` steps under torch.profiler recording the GPU
activity and the CPU ops (`--gpu-only`: the GPU activity alone). From the kernel records (device
time; memcpy and memset included) it reports per step:

- the step time (unprofiled, and with the profiler on), GPU busy time (the union of all kernel
  intervals, so overlapping streams count once) and idle time (the rest: gaps where the GPU waits;
  given against the profiled and the unprofiled step time, as the profiler slows the host a little);
- the time and share of each category (bench/kernel_categories.py: attention, matmul, norm,
  cross-entropy/softmax, elementwise, fused (compiled), embedding, optimizer, communication,
  memcpy/memset, other); shares are of the summed kernel time;
- the top kernels by time, with their count per step.

On the CPU (a smoke test) there are no kernels: the same report is made from the aten ops' self
CPU time instead. JSON goes to bench/results/profile-<preset>[-tag].json; `--trace PATH` also
writes a Chrome trace for chrome://tracing or Perfetto (tens of MB for llama3-1b).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for path in (str(REPO), str(BENCH)):
    if path not in sys.path:
        sys.path.insert(0, path)

import train_throughput as tt  # noqa: E402
from kernel_categories import CATEGORIES, categorize  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="llama3-1b", help="preset name or .toml path")
    p.add_argument("--steps", type=int, default=3, help="timed steps, then as many profiled")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--micro-batch-size", type=int, help="override train.micro_batch_size")
    p.add_argument("--global-batch-size", type=int, help="override train.global_batch_size")
    p.add_argument("--seq-length", type=int, help="override model.seq_length")
    p.add_argument("--compile", action="store_true", help="model.compile=true")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--override", nargs="+", action="extend", default=[], metavar="SECTION.KEY=V",
                   help="any config override, e.g. model.attention_backend=flash")
    p.add_argument("--seed", type=int, default=1234, help="seed of the random token batches")
    p.add_argument("--top", type=int, default=15, help="how many kernels to list")
    p.add_argument("--tag", default=None,
                   help="appended to the JSON name (default: 'compile' with --compile)")
    p.add_argument("--trace", default=None, metavar="PATH", help="also write a Chrome trace")
    p.add_argument("--gpu-only", action="store_true",
                   help="record only GPU activity (less host overhead; some torch versions then "
                   "miss kernels, so the default records the CPU ops too)")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/profile-<preset>[-tag].json); a copy "
                   "goes to $OUT when that variable is set")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be at least 1 and --warmup at least 0")
    return args


# --------------------------------------------------------------------------------------------
# Records -> summary (pure functions)


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


def summarize_kernels(records: list[tuple[str, float, float]], steps: int, wall_s: float,
                      top: int) -> dict:
    """Per-step numbers from (name, start_us, duration_us) records of `steps` steps that took
    `wall_s` seconds in all."""
    total_us = sum(d for _, _, d in records)
    busy_us = busy_time([(s, s + d) for _, s, d in records])
    per_cat: dict[str, float] = defaultdict(float)
    per_name: dict[str, list] = {}
    for name, _, dur in records:
        cat = categorize(name)
        per_cat[cat] += dur
        entry = per_name.setdefault(name, [0.0, 0, cat])
        entry[0] += dur
        entry[1] += 1
    step_s = wall_s / steps
    busy_s = busy_us / 1e6 / steps
    categories = {
        cat: {"time_s": per_cat[cat] / 1e6 / steps,
              "share": per_cat[cat] / total_us if total_us else 0.0}
        for cat in sorted(per_cat, key=per_cat.get, reverse=True)
    }
    kernels = [
        {"name": name[:400], "category": cat, "time_s": t / 1e6 / steps, "count": n / steps,
         "share": t / total_us if total_us else 0.0}
        for name, (t, n, cat) in sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    ]
    return {
        "profiled_step_s": step_s,
        "kernel_time_s": total_us / 1e6 / steps,  # summed: overlapping streams count twice
        "busy_s": busy_s,
        "idle_s": max(step_s - busy_s, 0.0),
        "busy_fraction": min(busy_s / step_s, 1.0) if step_s else 0.0,
        "kernels_per_step": len(records) / steps,
        "distinct_kernels": len(per_name),
        "categories": categories,
        "top_kernels": kernels,
    }


def device_records(prof) -> list[tuple[str, float, float]]:
    """(name, start us, duration us) of every GPU kernel, memcpy and memset. Ranges annotated on
    the GPU timeline (record_function regions such as torch.compile's) are not kernels: skipped."""
    from torch.autograd import DeviceType

    out = []
    for e in prof.events():
        if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
            continue
        if "annotation" in str(getattr(e, "activity_type", "") or "").lower():
            continue
        if e.name.startswith(("ProfilerStep", "## ")):  # annotations, should the flags miss
            continue
        out.append((e.name, e.time_range.start, e.time_range.end - e.time_range.start))
    return out


def cpu_records(prof) -> list[tuple[str, float, float]]:
    """(name, start us, self time us) of the CPU ops: the CPU smoke test's stand-in for kernels
    (self times do not overlap, so their sum is the busy time)."""
    out = []
    for e in prof.events():
        if e.name.startswith("ProfilerStep") or e.self_cpu_time_total <= 0:
            continue
        out.append((e.name, e.time_range.start, e.self_cpu_time_total))
    # lay the self times end to end: the union of intervals is then their sum
    t = 0.0
    laid = []
    for name, _, dur in sorted(out, key=lambda r: r[1]):
        laid.append((name, t, dur))
        t += dur
    return laid


# --------------------------------------------------------------------------------------------
# Running


def format_report(s: dict, top: int) -> str:
    lines = [
        f"step time {s['step_s']:.4f} s (no profiler), {s['profiled_step_s']:.4f} s profiled; "
        f"{s['source']} busy {s['busy_s']:.4f} s ({100 * s['busy_fraction']:.1f}%), "
        f"idle {s['idle_s']:.4f} s ({s['idle_unprofiled_s']:.4f} s against the unprofiled step); "
        f"{s['kernels_per_step']:,.0f} records per step",
        "",
        f"{'category':<24}{'s / step':>10}{'share':>8}",
        "-" * 42,
    ]
    for cat, v in s["categories"].items():
        lines.append(f"{cat:<24}{v['time_s']:>10.4f}{100 * v['share']:>7.1f}%")
    lines += ["", f"top {top}: {'s / step':>10}{'count':>8}{'share':>8}  category / name",
              "-" * 100]
    for k in s["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 120 else k["name"][:117] + "..."
        lines.append(f"{'':<8}{k['time_s']:>10.4f}{k['count']:>8.0f}{100 * k['share']:>7.1f}%  "
                     f"{k['category']}: {name}")
    return "\n".join(lines)


def profile(args: argparse.Namespace) -> tuple[dict, object]:
    from trireme.training.build import build_trainer

    cfg, overrides = tt.build_config(args)
    device = tt.pick_device(cfg.train.device)
    tt.reset_memory(device)
    t0 = time.perf_counter()
    trainer = build_trainer(cfg, with_data=False)
    tt.sync(device)
    build_s = time.perf_counter() - t0
    total = args.warmup + 2 * args.steps
    batches = tt.make_batches(cfg, trainer.device, args.seed, total)
    lr = cfg.optimizer.lr
    losses = []

    def step(i):
        loss = trainer.train_step(batches[i], lr)["loss"]
        losses.append(loss)
        return loss

    timed = tt.time_steps(step, device, args.warmup, args.steps)  # warmup, then timed steps

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU]
    if cuda:
        activities = [ProfilerActivity.CUDA] if args.gpu_only else [*activities,
                                                                     ProfilerActivity.CUDA]
    tt.sync(device)
    with torch_profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for i in range(args.steps):
            step(args.warmup + args.steps + i)
        tt.sync(device)
        wall = time.perf_counter() - t0
    records = device_records(prof) if cuda else cpu_records(prof)
    if not records:
        raise RuntimeError("the profiler recorded no kernels" + (
            "; try without --gpu-only" if args.gpu_only else ""))
    summary = summarize_kernels(records, args.steps, wall, args.top)
    values = [float(v) for v in torch.stack([v.float() for v in losses]).cpu()]
    summary.update({
        "source": "GPU" if cuda else "CPU ops",
        "step_s": sum(timed["step_times"]) / args.steps,
        "idle_unprofiled_s": max(sum(timed["step_times"]) / args.steps - summary["busy_s"], 0.0),
        "step_times_s": timed["step_times"],
        "tokens_per_s": cfg.train.global_batch_size * cfg.model.seq_length * args.steps
        / sum(timed["step_times"]),
        "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
        "build_s": build_s,
        "losses": values,
        "settings": {
            "preset": args.preset, "device": device.type,
            "micro_batch_size": cfg.train.micro_batch_size,
            "global_batch_size": cfg.train.global_batch_size,
            "seq_length": cfg.model.seq_length, "compile": cfg.model.compile,
            "attention_backend": cfg.model.attention_backend, "precision": cfg.model.precision,
            "warmup_steps": args.warmup, "timed_steps": args.steps,
            "profiled_steps": args.steps, "seed": args.seed, "overrides": overrides,
        },
    })
    if args.trace:
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(args.trace)
        summary["trace"] = str(args.trace)
    return summary, device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tag = args.tag if args.tag is not None else ("compile" if args.compile else "")
    summary, device = profile(args)
    s = summary["settings"]
    print(f"profile_step: {args.preset} on {tt.device_name(device)}, micro batch "
          f"{s['micro_batch_size']} x {s['global_batch_size'] // s['micro_batch_size']}, seq "
          f"{s['seq_length']}, compile {s['compile']}; {args.steps} profiled steps")
    print(format_report(summary, args.top))
    if summary.get("trace"):
        print(f"trace: {summary['trace']}")
    data = {
        **tt.run_header("profile_step", device, argv),
        "categories_known": list(CATEGORIES),
        **summary,
    }
    name = f"profile-{Path(args.preset).stem}" + (f"-{tag}" if tag else "") + ".json"
    out = Path(args.out or REPO / "bench" / "results" / name)
    tt.write_json(out, data)
    print(f"wrote {out}")
    if os.environ.get("OUT"):
        tt.write_json(Path(os.environ["OUT"]) / out.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
