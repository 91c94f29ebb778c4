"""The decode step's GEMMs (y = x W^T, x [M, K] with M the batch, W [N, K]) in two layouts on one
GPU: F.linear(x, W) (what the model calls: cuBLAS picks a kernel for M x N x K), and the same
product computed transposed, (W x^T)^T = mm(W, x^T).t() (cuBLAS sees N x M x K and may pick
another kernel, e.g. one without split-K). Each is timed as one CUDA graph of many launches cycling
over enough weight copies not to be served from the L2, as the layers of a step are; the rate is
the weight bytes read per second. Prints a table, writes JSON.

    python bench/gemm_layouts.py --out bench/results/gemm_layouts.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

# llama3-1b: qkv, out, gate_up, down, output layer (N, K)
SHAPES = {"qkv": (3072, 2048), "out": (2048, 2048), "gate_up": (16384, 2048),
          "down": (2048, 8192), "output": (128256, 2048)}


def timed_us(fn, weights, x, reps: int) -> float:
    for w in weights:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(x, weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / (5 * reps)


def linear(x, w):
    return F.linear(x, w)


def transposed(x, w):
    return torch.mm(w, x.t()).t()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--out", default="bench/results/gemm_layouts.json")
    args = p.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    rows = []
    print(f"{'gemm':>8} {'M':>4}  linear us  transposed us  linear TB/s  transposed TB/s  max diff")
    for name, (n, k) in SHAPES.items():
        copies = max(2, -(-(256 << 20) // (n * k * 2)))
        weights = [torch.randn(n, k, device=dev, dtype=dt) * 0.02 for _ in range(copies)]
        for m in (int(b) for b in args.batches.split(",")):
            x = torch.randn(m, k, device=dev, dtype=dt)
            diff = (linear(x, weights[0]).float() - transposed(x, weights[0]).float()).abs().max()
            a = timed_us(linear, weights, x, 64)
            b = timed_us(transposed, weights, x, 64)
            gb = n * k * 2
            rows.append({"gemm": name, "m": m, "n": n, "k": k, "linear_us": a,
                         "transposed_us": b, "max_diff": diff.item()})
            print(f"{name:>8} {m:>4}  {a:9.2f}  {b:13.2f}  {gb / a / 1e6:11.2f}  "
                  f"{gb / b / 1e6:15.2f}  {diff.item():.2e}", flush=True)
        del weights
    write_rows(args.out, rows)
    return 0


def write_rows(out: str, rows: list[dict]) -> None:
    """The JSON of a GEMM benchmark: the GPU, torch's version, the rows."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                     "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    raise SystemExit(main())
