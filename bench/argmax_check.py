"""The decode step's greedy ids + finite flags (trireme.ops.argmax) on the GPU: the Triton split
reduction against torch's argmax and isfinite(...).all, for correctness and speed.

    python bench/argmax_check.py                           # [64, 128256] and [256, 128256] bf16
    python bench/argmax_check.py --shapes 1x128256 64x151936 --dtype float32
    TRITON_INTERPRET=1 python bench/argmax_check.py --device cpu --shapes 3x50 --iters 1 \\
        --no-sweep                                         # smoke test (the CPU interpreter)

For each shape [n, V], random logits (randn * 4, in --dtype) with a few planted cases: a tie of
the maximum in two rows across the row (the first index must win), one row with a NaN, one with
+inf, one with -inf. The kernel's [2, n] (ids, finite) must equal torch's exactly.

Speed: CUDA events around --reps back-to-back calls, the median over --iters measurements after
--warmup, divided by --reps:
  - torch: argmax alone, isfinite(...).all alone, and the engine's old path (both, stacked into
    [2, n] int64: trireme.ops.argmax.greedy_and_finite_reference);
  - kernel: trireme.ops.argmax_triton.greedy_and_finite at its default tiling, and (unless
    --no-sweep) at other (block, programs per SM, min chunk, num_warps) choices.
GB/s counts one read of the logits (n * V * itemsize bytes). Prints a table, writes
bench/results/argmax_check.json (a copy to $OUT when set); exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.ops.argmax import greedy_and_finite_reference  # noqa: E402
from trireme.ops.argmax_triton import greedy_and_finite, split  # noqa: E402

# (block, programs per SM, min chunk, warps) for the sweep; the default is (2048, 4, 4096, 4)
SWEEP = [(2048, 2, 4096, 4), (2048, 8, 4096, 4), (1024, 4, 4096, 4), (4096, 4, 4096, 8),
         (4096, 4, 8192, 4), (2048, 4, 2048, 4), (2048, 4, 8192, 8), (2048, 16, 2048, 4),
         (1024, 8, 2048, 2)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["64x128256", "256x128256"], help="nxV")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--iters", type=int, default=20, help="timed measurements")
    p.add_argument("--reps", type=int, default=20, help="calls per measurement")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-sweep", action="store_true", help="the default tiling only")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "argmax_check.json"))
    return p.parse_args(argv)


def logits_of(n: int, v: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Random [n, V] logits with planted ties, NaN, +inf, -inf (module docstring)."""
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(n, v, generator=gen) * 4
    for row, cols in ((0, [v // 3, v - 1]), (min(1, n - 1), [1, v // 2])):
        z[row, cols] = z[row].max() + 1.0  # a tie: the first column wins
    for row, value in ((2, float("nan")), (3, float("inf")), (4, float("-inf"))):
        if row < n:
            z[row, (row * 7919) % v] = value
    return z.to(dtype).to(device)


def timed(fn, args: argparse.Namespace, cuda: bool) -> float:
    """Median seconds per call of fn() (module docstring)."""
    for _ in range(args.warmup):
        fn()
    samples = []
    for _ in range(args.iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(args.reps):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / args.reps)
        else:
            t0 = time.perf_counter()
            for _ in range(args.reps):
                fn()
            samples.append((time.perf_counter() - t0) / args.reps)
    return statistics.median(samples)


def measure(shape: str, args: argparse.Namespace) -> list[dict]:
    n, v = (int(x) for x in shape.split("x"))
    cuda = args.device == "cuda"
    z = logits_of(n, v, getattr(torch, args.dtype), args.device)
    nbytes = z.numel() * z.element_size()
    sms = torch.cuda.get_device_properties(z.device).multi_processor_count if cuda else 1
    want = greedy_and_finite_reference(z)
    rows = []

    def row(name: str, fn, check: bool = False, **extra) -> None:
        r = {"shape": shape, "dtype": args.dtype, "path": name, **extra}
        try:
            if check:
                r["equal"] = bool(torch.equal(fn(), want))
            s = timed(fn, args, cuda)
            r.update(us=s * 1e6, gb_s=nbytes / s / 1e9)
        except Exception as e:  # one failed variant: recorded, the others still run
            r["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(r)

    row("torch argmax", lambda: z.argmax(dim=-1))
    row("torch isfinite.all", lambda: torch.isfinite(z).all(dim=-1))
    row("torch both (engine before)", lambda: greedy_and_finite_reference(z))
    programs = 4 * sms
    row("kernel default", lambda: greedy_and_finite(z), check=True,
        split=list(split(n, v, programs)))
    for block, per_sm, min_chunk, warps in [] if args.no_sweep else SWEEP:
        row(f"kernel b{block} p{per_sm} c{min_chunk} w{warps}",
            lambda b=block, p=per_sm, c=min_chunk, w=warps: greedy_and_finite(
                z, block=b, programs=p * sms, min_chunk=c, num_warps=w),
            check=True, split=list(split(n, v, per_sm * sms, block, min_chunk)))
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU (use --device cpu for a smoke test)")
        return 2
    results = [r for shape in args.shapes for r in measure(shape, args)]
    print(f"{'shape':>12} {'path':<30} {'us':>9} {'GB/s':>8}  equal / split")
    for r in results:
        tail = r.get("error") or f"{r.get('equal', '')} {r.get('split', '')}"
        us, gbs = r.get("us", float("nan")), r.get("gb_s", float("nan"))
        print(f"{r['shape']:>12} {r['path']:<30} {us:>9.1f} {gbs:>8.0f}  {tail}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                            capture_output=True, text=True).stdout.strip()
    data = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.machine(),
            "torch": torch.__version__, "git_commit": commit, "settings": vars(args),
            "results": results}
    text = json.dumps(data, indent=1)
    paths = [Path(args.out)] + ([Path(os.environ["OUT"]) / Path(args.out).name]
                                if os.environ.get("OUT") else [])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
    bad = [r for r in results if r.get("equal") is False or "error" in r]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
