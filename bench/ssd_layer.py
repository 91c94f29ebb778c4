"""Mamba-2: the SSD scan and the whole `M` sublayer, forward + backward tokens/s, in one process.

    python bench/ssd_layer.py                     # hidden 2048 / 4096, seq 4k-16k, bf16
    python bench/ssd_layer.py --hidden 4096 --seqs 16384 --iters 5
    python bench/ssd_layer.py --smoke             # CPU, tiny, one iteration

Shapes follow Nemotron-H's mixers: d_inner = 2 x hidden, head_dim 64, d_state 128, 8 groups,
chunks of 128, batch 1 (--batch). For each (hidden, seq):
1. scan: x, dt, A, B, C -> y (trireme.ops.ssd.ssd_scan), forward + backward, paths
   `torch` (eager), `compiled` (torch.compile of the same function; CUDA only), `triton`
   (trireme's within-chunk kernels, trireme.ops.ssd_triton; CUDA only) and `mamba_ssm`
   (mamba_ssm's Triton mamba_chunk_scan_combined, when the package imports); the error of each
   against `torch` (relative max of y and dx) is reported.
2. layer: the whole sublayer (in_proj, conv, scan, gated norm, out_proj; trireme.models.mamba),
   `torch`, `compiled`, `triton` and `mamba_ssm` (model.mamba_kernels, when it imports).
   TFLOP/s count Megatron's FLOPs for the layer (trireme.models.stages: forward x 3).
Times are the median of --iters after --warmup (CUDA synchronized). A path that runs out of
memory is reported as "oom". Prints a table, writes bench/results/ssd_layer.json (and a copy to
$OUT when set).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

for p in (Path(__file__).resolve().parent, Path(__file__).resolve().parents[1]):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import train_throughput as tt  # noqa: E402

from trireme.config import ModelConfig  # noqa: E402
from trireme.models.mamba import Mamba  # noqa: E402
from trireme.ops.ssd import discretize_dt, fast_ssd_kernels, ssd_scan  # noqa: E402
from trireme.parallel.context import ParallelContext  # noqa: E402


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", default="2048,4096")
    p.add_argument("--seqs", default="4096,8192,16384")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--state", type=int, default=128)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="CPU, hidden 64, seq 200, one iteration")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "ssd_layer.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.seqs, args.iters, args.warmup = "64", "200", 1, 0
        args.head_dim, args.state, args.groups, args.chunk = 16, 16, 2, 32
    return args


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_it(fn, device: torch.device, iters: int, warmup: int) -> float:
    """Median seconds of fn() (forward + backward)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def scan_inputs(args, hidden: int, seq: int, device, dtype):
    heads = 2 * hidden // args.head_dim
    g = torch.Generator(device=device).manual_seed(0)
    rand = lambda *s: torch.randn(*s, device=device, generator=g)  # noqa: E731
    b, n = args.batch, args.state
    x = rand(b, seq, heads, args.head_dim).to(dtype).requires_grad_()
    dt = discretize_dt(rand(b, seq, heads) - 3.0, None, True, (0.0, float("inf")))
    A = -torch.exp(rand(heads) * 0.5)
    B = rand(b, seq, args.groups, n).to(dtype).requires_grad_()
    C = rand(b, seq, args.groups, n).to(dtype).requires_grad_()
    return x, dt.requires_grad_(), A.requires_grad_(), B, C


def scan_paths(args, device):
    paths = {"torch": lambda x, dt, A, B, C: ssd_scan(x, dt, A, B, C, args.chunk)[0]}
    if device.type == "cuda":
        paths["compiled"] = torch.compile(paths["torch"])
        paths["triton"] = lambda x, dt, A, B, C: ssd_scan(x, dt, A, B, C, args.chunk,
                                                          triton=True)[0]
        fast = fast_ssd_kernels(device)
        if fast is not None:
            paths["mamba_ssm"] = lambda x, dt, A, B, C: fast.scan(x, dt, A, B, C, args.chunk)
    return paths


def bench_scan(args, hidden: int, seq: int, device, dtype) -> list[dict]:
    inputs = scan_inputs(args, hidden, seq, device, dtype)
    results, ref = [], None
    for name, fn in scan_paths(args, device).items():
        row = {"part": "scan", "path": name, "hidden": hidden, "seq": seq}
        try:
            y = fn(*inputs)
            dy = torch.ones_like(y) / y.numel() ** 0.5
            (dx,) = torch.autograd.grad(y, inputs[0], dy)
            if ref is None:
                ref = (y.detach().float(), dx.float())
            row["error"] = max(float((a.detach().float() - r).abs().max() / r.abs().max())
                               for a, r in zip((y, dx), ref))

            def step(fn=fn, dy=dy):
                out = fn(*inputs)
                torch.autograd.grad(out, inputs, dy)

            row["seconds"] = time_it(step, device, args.iters, args.warmup)
            row["tokens_per_s"] = args.batch * seq / row["seconds"]
        except torch.OutOfMemoryError:
            row["seconds"] = "oom"
        results.append(row)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return results


def layer_paths(args, hidden: int, device, dtype) -> tuple[ModelConfig, dict]:
    """The sublayer per path: the plain scan eager and compiled, and mamba_ssm's kernels."""
    cfg = ModelConfig(hidden_size=hidden, layer_pattern="M", num_layers=1,
                      mamba_state_dim=args.state, mamba_head_dim=args.head_dim,
                      mamba_num_groups=args.groups, mamba_chunk_size=args.chunk,
                      mamba_kernels="torch")
    layer = Mamba(cfg, ParallelContext()).to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.normal_(0.0, 0.02) if p.dim() > 1 else p.fill_(0.5 if name != "A_log" else 0.0)
    paths = {"torch": layer}
    if device.type == "cuda":
        paths["compiled"] = torch.compile(layer)
        own = Mamba(dataclasses.replace(cfg, mamba_kernels="triton"), ParallelContext())
        own.load_state_dict(layer.state_dict())
        paths["triton"] = own.to(device=device, dtype=dtype)
        if fast_ssd_kernels(device) is not None:
            fast = Mamba(dataclasses.replace(cfg, mamba_kernels="mamba_ssm"), ParallelContext())
            fast.load_state_dict(layer.state_dict())
            paths["mamba_ssm"] = fast.to(device=device, dtype=dtype)
    return cfg, paths


def bench_layer(args, hidden: int, seq: int, device, dtype) -> list[dict]:
    cfg, paths = layer_paths(args, hidden, device, dtype)
    x = torch.randn(args.batch, seq, hidden, device=device, dtype=dtype, requires_grad=True)
    dy = torch.randn_like(x)
    flops = 6 * Mamba.flops(cfg) * args.batch * seq
    results = []
    for name, module in paths.items():
        row = {"part": "layer", "path": name, "hidden": hidden, "seq": seq}
        try:
            def step(module=module):
                module(x).backward(dy)

            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            row["seconds"] = time_it(step, device, args.iters, args.warmup)
            row["tokens_per_s"] = args.batch * seq / row["seconds"]
            row["tflops"] = flops / row["seconds"] / 1e12
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        except torch.OutOfMemoryError:
            row["seconds"] = "oom"
        results.append(row)
        torch.cuda.empty_cache() if device.type == "cuda" else None
    return results


def table(rows: list[dict]) -> str:
    lines = [f"{'part':6} {'path':10} {'hidden':>6} {'seq':>6} {'ms':>9} {'tok/s':>10} "
             f"{'TFLOP/s':>8} {'err':>8}"]
    for r in rows:
        secs = r["seconds"]
        ms = f"{secs * 1e3:9.1f}" if secs != "oom" else f"{'oom':>9}"
        tok = f"{r['tokens_per_s']:10,.0f}" if "tokens_per_s" in r else f"{'-':>10}"
        tf = f"{r['tflops']:8.1f}" if "tflops" in r else f"{'-':>8}"
        err = f"{r['error']:8.1e}" if "error" in r else f"{'-':>8}"
        lines.append(f"{r['part']:6} {r['path']:10} {r['hidden']:>6} {r['seq']:>6} {ms} {tok} "
                     f"{tf} {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for hidden in map(int, args.hidden.split(",")):
        for seq in map(int, args.seqs.split(",")):
            new = bench_scan(args, hidden, seq, device, dtype)
            new += bench_layer(args, hidden, seq, device, dtype)
            print(table(new).split("\n", 1)[1], flush=True)  # progress, row by row
            rows += new
    print("\n" + table(rows))
    data = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype), "args": vars(args), "rows": rows,
            "mamba_ssm": fast_ssd_kernels(device) is not None}
    out = Path(args.out)
    tt.write_json(out, data)
    if os.environ.get("OUT"):
        tt.write_json(Path(os.environ["OUT"]) / out.name, data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
