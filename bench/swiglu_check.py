"""The fused SwiGLU backward (model.fused_swiglu) on the GPU: its error, and its speed against
torch.compile's own backward of the plain silu(gate) * up.

    python bench/swiglu_check.py                       # [65536, 2*8192] and [32768, 2*14336], bf16
    python bench/swiglu_check.py --shapes 65536x8192 --iters 50
    python bench/swiglu_check.py --device cpu --shapes 64x72 --no-compile --iters 2   # smoke test

For each shape [M, 2F] (M tokens, F = ffn; llama3-1b and llama3-8b widths by default), random bf16
h = [gate; up] and dy:

1. Correctness: dh from trireme.ops.swiglu_triton (the Triton kernel) against the fp32 formula
   on the same bf16 inputs (trireme.ops.swiglu.swiglu_backward_reference without its final
   rounding). One rounding to bf16 is half an ulp (2^-8 relative); the kernel's fp32 sigmoid may
   differ from torch's in the last fp32 bits, which can move a result to the next bf16 value: the
   largest elementwise relative error must stay under --tol (default 2^-7, one ulp). The compiled
   plain backward's error is printed too (it rounds silu(gate) and dy * up to bf16 first).
2. Speed, CUDA events around each iteration, the median of --iters after --warmup:
   - plain: torch.compile(swiglu) forward alone (with grad) and forward + backward;
   - fused: torch.compile(fused_swiglu) (the same compiled forward, the Triton kernel as the
     backward), the same two;
   - the Triton kernel alone, at its default tile and at a few others (--no-sweep skips them).
   The backward's time is (forward + backward) - forward; its GB/s counts the ideal traffic, one
   read of h and dy and one write of dh: 5 * M * F * 2 bytes.

`--device cpu` runs the same code with the custom op's plain torch implementation in place of the
kernel: a smoke test of the script, not a measurement. Prints a table, writes
bench/results/swiglu_check.json (a copy to $OUT when set), exits 1 if a check fails (2 without a
CUDA GPU unless --device cpu).
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_throughput as tt  # noqa: E402

from trireme.ops.swiglu import (  # noqa: E402
    fused_swiglu,
    swiglu,
    swiglu_backward,
    swiglu_backward_reference,
)

# (block_cols, block_rows, num_warps) tried for the kernel alone; None: the launcher's default
SWEEP = [(None, None, 8), (1024, 4, 4), (512, 8, 4), (2048, 2, 8), (1024, 8, 8), (256, 16, 4),
         (1024, 2, 4)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["65536x8192", "32768x14336"],
                   help="MxF: tokens x ffn (h is [M, 2F])")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tol", type=float, default=2**-7,
                   help="max elementwise relative error of the kernel vs the fp32 formula")
    p.add_argument("--no-compile", action="store_true", help="eager forward (smoke tests)")
    p.add_argument("--no-sweep", action="store_true", help="time the kernel at its default tile")
    p.add_argument("--no-large", action="store_true",
                   help="skip the check of an h past 2^31 elements (64-bit offsets; CUDA only)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "swiglu_check.json"))
    return p.parse_args(argv)


def inputs(m: int, ffn: int, device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    h = 2 * torch.randn(m, 2 * ffn, device=device, generator=gen, dtype=torch.bfloat16)
    dy = torch.randn(m, ffn, device=device, generator=gen, dtype=torch.bfloat16)
    return h, dy


def kernel(device: str):
    """The backward under test: the Triton launcher on CUDA, the custom op elsewhere."""
    if device == "cuda":
        from trireme.ops.swiglu_triton import swiglu_backward as launch

        return launch
    return lambda h, dy, **_: swiglu_backward(h, dy)


def errors(dh: torch.Tensor, ref: torch.Tensor) -> dict:
    """Max abs, max elementwise relative (where |ref| > 1e-6 max |ref|), Frobenius relative."""
    diff = (dh.float() - ref).abs()
    big = ref.abs() > 1e-6 * ref.abs().max()
    return {
        "max_abs": float(diff.max()),
        "max_rel": float((diff[big] / ref.abs()[big]).max()),
        "rel_fro": float(diff.norm() / ref.norm()),
    }


def check(m: int, ffn: int, args, plain) -> dict:
    h, dy = inputs(m, ffn, args.device)
    ref = swiglu_backward_reference(h.float(), dy.float())  # fp32, not rounded
    dh = kernel(args.device)(h, dy)
    result = {"kernel": errors(dh, ref), "finite": bool(torch.isfinite(dh).all())}
    del dh
    hg = h.detach().clone().requires_grad_()
    plain(hg).backward(dy)
    result["plain_compiled"] = errors(hg.grad, ref)
    result["pass"] = result["kernel"]["max_rel"] <= args.tol and result["finite"]
    return result


def check_large(args, ffn: int = 8192, tail: int = 2048) -> dict:
    """An h of more than 2^31 elements, where the kernel's offsets need 64 bits: its last `tail`
    rows (and its first, for contrast) against the reference. About 11 GB of bf16 tensors."""
    m = 2**31 // (2 * ffn) + tail  # the last `tail` rows start past element 2^31
    h, dy = inputs(m, ffn, args.device, seed=2)
    dh = kernel(args.device)(h, dy)
    result = {"shape": [m, 2 * ffn], "elements": m * 2 * ffn}
    for name, rows in (("first", slice(0, tail)), ("last", slice(m - tail, m))):
        ref = swiglu_backward_reference(h[rows].float(), dy[rows].float())
        result[name] = errors(dh[rows], ref)
    result["finite"] = bool(torch.isfinite(dh[-tail:]).all())
    result["pass"] = result["finite"] and all(result[k]["max_rel"] <= args.tol
                                              for k in ("first", "last"))
    return result


def time_it(step, args) -> float:
    """Median milliseconds of `step()`, each iteration between two CUDA events."""
    for _ in range(args.warmup):
        step()
    if args.device == "cpu":
        times = []
        for _ in range(args.iters):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(args.iters + 1)]
    events[0].record()
    for i in range(args.iters):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(args.iters))


def bench(m: int, ffn: int, args, fns: dict) -> dict:
    h, dy = inputs(m, ffn, args.device, seed=1)
    h.requires_grad_()
    gbytes = 5 * m * ffn * h.element_size() / 1e9  # read h and dy, write dh
    result = {}
    for name, fn in fns.items():
        def forward(fn=fn):
            fn(h)  # with grad: what the training forward runs (the graph is freed at once)

        def forward_backward(fn=fn):
            h.grad = None
            fn(h).backward(dy)

        fwd, fwd_bwd = time_it(forward, args), time_it(forward_backward, args)
        bwd = fwd_bwd - fwd
        result[name] = {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "bwd_ms": bwd,
                        "bwd_gb_s": gbytes / bwd * 1e3 if bwd > 0 else None}
    result["speedup_fwd_bwd"] = result["plain"]["fwd_bwd_ms"] / result["fused"]["fwd_bwd_ms"]
    launch = kernel(args.device)
    hd = h.detach()
    configs = SWEEP[:1] if args.no_sweep or args.device == "cpu" else SWEEP
    result["kernel"] = []
    for cols, rows, warps in configs:
        step = functools.partial(launch, hd, dy, block_cols=cols, block_rows=rows,
                                 num_warps=warps)
        ms = time_it(step, args)
        result["kernel"].append({"block_cols": cols, "block_rows": rows, "num_warps": warps,
                                 "ms": ms, "gb_s": gbytes / ms * 1e3})
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("swiglu_check: needs a CUDA GPU (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    out = Path(args.out)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes]
    if args.no_compile:
        fns = {"plain": swiglu, "fused": fused_swiglu}
    else:
        fns = {"plain": torch.compile(swiglu, dynamic=False),
               "fused": torch.compile(fused_swiglu, dynamic=False)}
    data = {
        **tt.run_header("swiglu_check", torch.device(args.device), argv),
        "settings": {"shapes": [list(s) for s in shapes], "dtype": "bfloat16",
                     "iters": args.iters, "warmup": args.warmup, "tol": args.tol,
                     "compile": not args.no_compile},
        "checks": {}, "bench": {},
    }

    def save() -> None:
        tt.write_json(out, data)
        if os.environ.get("OUT"):
            tt.write_json(Path(os.environ["OUT"]) / out.name, data)

    failed = False
    print(f"swiglu_check on {data['device']}, torch {torch.__version__}, bf16")
    print(f"{'M x F':<14}{'kernel max rel':>16}{'max abs':>10}{'rel fro':>10}"
          f"{'plain max rel':>15}")
    for m, ffn in shapes:
        key = f"{m}x{ffn}"
        try:
            r = check(m, ffn, args, fns["plain"])
        except Exception as e:
            traceback.print_exc()
            data["checks"][key] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
            continue
        data["checks"][key] = r
        failed |= not r["pass"]
        k, p = r["kernel"], r["plain_compiled"]
        print(f"{key:<14}{k['max_rel']:>16.2e}{k['max_abs']:>10.1e}{k['rel_fro']:>10.1e}"
              f"{p['max_rel']:>15.2e}   {'ok' if r['pass'] else 'FAIL'}")
        if cuda:
            torch.cuda.empty_cache()
    if cuda and not args.no_large:
        try:
            r = check_large(args)
        except Exception as e:
            traceback.print_exc()
            r = {"error": f"{type(e).__name__}: {e}", "pass": False}
        data["checks"]["large"] = r
        failed |= not r["pass"]
        if "error" not in r:
            print(f"{'x'.join(map(str, r['shape'])):<14}{r['last']['max_rel']:>16.2e}"
                  f"{r['last']['max_abs']:>10.1e}{r['last']['rel_fro']:>10.1e}{'-':>15}   "
                  f"{'ok' if r['pass'] else 'FAIL'} (last rows, past 2^31 elements)")
        torch.cuda.empty_cache()
    save()

    print(f"\n{'M x F':<14}{'path':<8}{'fwd ms':>9}{'fwd+bwd ms':>12}{'bwd ms':>9}{'bwd GB/s':>10}")
    for m, ffn in shapes:
        key = f"{m}x{ffn}"
        try:
            r = bench(m, ffn, args, fns)
        except Exception as e:
            traceback.print_exc()
            data["bench"][key] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
            continue
        data["bench"][key] = r
        for name in fns:
            t = r[name]
            gb_s = f"{t['bwd_gb_s']:.0f}" if t["bwd_gb_s"] else "-"
            print(f"{key:<14}{name:<8}{t['fwd_ms']:>9.3f}{t['fwd_bwd_ms']:>12.3f}"
                  f"{t['bwd_ms']:>9.3f}{gb_s:>10}")
        print(f"{'':<14}fwd+bwd speedup {r['speedup_fwd_bwd']:.2f}x; kernel alone:")
        for c in r["kernel"]:
            tile = (f"{c['block_rows']}x{c['block_cols']}" if c["block_cols"] else "default")
            print(f"{'':<16}tile {tile:<9} warps {c['num_warps']}: {c['ms']:.3f} ms, "
                  f"{c['gb_s']:.0f} GB/s")
        save()
        if cuda:
            torch.cuda.empty_cache()
    data["pass"] = not failed
    save()
    print(f"{'PASS' if not failed else 'FAIL'}; wrote {out} ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
