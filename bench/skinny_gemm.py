"""The decode step's GEMMs (y = x W^T, x [M, K], W [N, K]) by cuBLAS (F.linear) against the split-K
Triton kernel (trireme.ops.skinny_gemm_triton) over a sweep of its tilings, on one GPU. Each is
timed as one CUDA graph of many launches cycling over enough weight copies not to be served
from the L2 (as the layers of a step are); a split kernel is timed with its fp32 sum and cast
(`reduce`: a separate kernel here, fused into the next one in a compiled decode step) and
without. Prints the best tiling per (GEMM, M) and the plan skinny_linear takes now, writes JSON
(`best` has what trireme.ops.skinny_gemm's SPLITS / TILES tables are filled from).

    python bench/skinny_gemm.py --out bench/results/skinny_gemm.json
    python bench/skinny_gemm.py --gemms down --glu   # the fused gate_up + SwiGLU kernel too
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch
import torch.nn.functional as F
from gemm_layouts import timed_us, write_rows  # bench/, the script's folder

from trireme.ops.skinny_gemm import skinny_linear, tile_for, usable
from trireme.ops.skinny_gemm_triton import skinny_mm

# llama3-1b: qkv, out, gate_up, down (N, K)
REPS = 32  # launches in each timed CUDA graph
SHAPES = {"qkv": (3072, 2048), "out": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192)}


def candidates(k: int, quick: bool):
    """(splits, block_n, block_k, swap, num_stages) to try for K = k."""
    grid = itertools.product((1, 2, 4, 8, 16), (32, 64, 128), (128, 256), (False, True),
                             (3, 5) if not quick else (4,))
    for splits, bn, bk, swap, stages in grid:
        if k % (splits * bk) == 0:
            yield splits, bn, bk, swap, stages


def kernel_fn(splits, bn, bk, bm, swap, stages, reduce: bool):
    def fn(x, w):
        part = skinny_mm(x, w, splits, bn, bk, bm, swap, 4, stages)
        return part.sum(0).to(x.dtype) if reduce and splits > 1 else part
    return fn


def sweep_one(name, n, k, m, weights, quick) -> dict:
    dev, dt = weights[0].device, weights[0].dtype
    x = torch.randn(m, k, device=dev, dtype=dt)
    want = F.linear(x, weights[0]).float()
    cublas = timed_us(lambda a, w: F.linear(a, w), weights, x, REPS)
    bm = 16 if m <= 16 else 64
    tried = []
    for splits, bn, bk, swap, stages in candidates(k, quick):
        fn = kernel_fn(splits, bn, bk, bm, swap, stages, True)
        try:
            got = fn(x, weights[0])[0] if splits == 1 else fn(x, weights[0])
        except Exception as e:  # a tiling Triton cannot compile: say so, try the next
            print(f"  {name} M={m} {(splits, bn, bk, bm, swap, stages)}: {type(e).__name__}: "
                  f"{str(e)[:120]}")
            continue
        err = (got.float() - want).abs().max().item()
        total = timed_us(fn, weights, x, REPS)
        alone = total if splits == 1 else timed_us(
            kernel_fn(splits, bn, bk, bm, swap, stages, False), weights, x, REPS)
        tried.append({"splits": splits, "block_n": bn, "block_k": bk, "block_m": bm,
                      "swap": swap, "num_stages": stages, "us": total, "kernel_us": alone,
                      "max_diff": err})
    best = min(tried, key=lambda r: r["us"])
    now = usable(x, weights[0])
    plan_us = timed_us(lambda a, w: skinny_linear(a, w), weights, x, REPS) if now else None
    return {"gemm": name, "m": m, "n": n, "k": k, "cublas_us": cublas, "best": best,
            "plan_splits": now, "plan_tile": str(tile_for(m, n, k, now)[0]) if now else None,
            "plan_us": plan_us, "tried": tried}


def glu_one(n, k, m, weights, quick) -> dict:
    """SwiGLU's first layer [W_gate; W_up] (n = 2F rows): cuBLAS + the activation compiled
    (what the compiled decode step runs) against the fused GLU kernel's tilings."""
    dev, dt = weights[0].device, weights[0].dtype
    x = torch.randn(m, k, device=dev, dtype=dt)
    act = torch.compile(lambda h: F.silu(h[:, : n // 2]) * h[:, n // 2 :])
    want = act(F.linear(x, weights[0])).float()
    plain = timed_us(lambda a, w: act(F.linear(a, w)), weights, x, REPS)
    bm, tried = 16 if m <= 16 else 64, []
    for splits, bn, bk, swap, stages in candidates(k, quick):
        if splits != 1:  # one split: the activation needs the whole sums
            continue
        fn = lambda a, w, bn=bn, bk=bk, swap=swap, stages=stages: skinny_mm(  # noqa: E731
            a, w, 1, bn, bk, bm, swap, 4, stages, glu=True)
        try:
            err = (fn(x, weights[0])[0].float() - want).abs().max().item()
        except Exception as e:  # a tiling Triton cannot compile
            print(f"  glu M={m} {(bn, bk, bm, swap, stages)}: {type(e).__name__}")
            continue
        tried.append({"block_n": bn, "block_k": bk, "block_m": bm, "swap": swap,
                      "num_stages": stages, "us": timed_us(fn, weights, x, REPS), "max_diff": err})
    return {"gemm": "gate_up+swiglu", "m": m, "n": n, "k": k, "cublas_us": plain,
            "best": min(tried, key=lambda r: r["us"]), "tried": tried}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--gemms", default=",".join(SHAPES))
    p.add_argument("--quick", action="store_true", help="one pipeline depth (4), not 3 and 5")
    p.add_argument("--glu", action="store_true",
                   help="also gate_up + SwiGLU: cuBLAS and the compiled activation against "
                   "the fused kernel (trireme.ops.skinny_gemm's GLU_TILES)")
    p.add_argument("--out", default="bench/results/skinny_gemm.json")
    args = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows, t0 = [], time.time()
    print(f"{'gemm':>8} {'M':>4}  cuBLAS us  best us (kernel)  TB/s  x cuBLAS  "
          "best tiling (splits, bn, bk, bm, swap, stages)  plan us  max diff")
    for name in args.gemms.split(","):
        n, k = SHAPES[name]
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        for m in (int(b) for b in args.batches.split(",")):
            r = sweep_one(name, n, k, m, weights, args.quick)
            rows.append(r)
            b = r["best"]
            tiling = (b["splits"], b["block_n"], b["block_k"], b["block_m"], int(b["swap"]),
                      b["num_stages"])
            plan = f"{r['plan_us']:.2f}" if r["plan_us"] else "-"
            print(f"{name:>8} {m:>4}  {r['cublas_us']:9.2f}  {b['us']:7.2f} ({b['kernel_us']:5.2f})"
                  f"  {n * k * 2 / b['us'] / 1e6:4.2f}  {r['cublas_us'] / b['us']:8.2f}  "
                  f"{str(tiling):>44}  {plan:>7}  {b['max_diff']:.1e}", flush=True)
        del weights
    if args.glu:
        n, k = SHAPES["gate_up"]
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(5)]
        for m in (int(b) for b in args.batches.split(",") if int(b) <= 64):
            r = glu_one(n, k, m, weights, args.quick)
            rows.append(r)
            b = r["best"]
            tiling = (b["block_n"], b["block_k"], b["block_m"], b["swap"], b["num_stages"])
            print(f"gate_up+swiglu M={m}: cuBLAS + activation {r['cublas_us']:.2f} us, fused "
                  f"{b['us']:.2f} us with {tiling}, max diff {b['max_diff']:.1e}", flush=True)
    print(f"sweep took {time.time() - t0:.0f} s")
    write_rows(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
