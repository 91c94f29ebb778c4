"""FP8 linear on the GPU: the _scaled_mm path against its emulation, and its speed against bf16.

    python bench/fp8_check.py                    # llama3-1b shapes, 8192 tokens
    python bench/fp8_check.py --no-compile --iters 10
    python bench/fp8_check.py --device cpu --shrink 16 --tokens 256 --no-compile   # smoke test

1. Correctness: for each linear shape of the llama3-1b blocks (qkv, out, fc1, fc2) at `--tokens`
   tokens, random bf16 x, W and dL/dy; trireme.ops.fp8.fp8_linear forward + backward through
   torch._scaled_mm against the same with emulate=True (quantize -> dequantize in fp32, plain
   matmul). They differ only by accumulation order and the bf16 rounding of the outputs, so the
   relative (Frobenius) error of y, dx and dW must stay under --tol. The error of fp8 itself
   against an fp32 linear is printed too (information: fp8 rounds ~2^-4 per element).
2. Speed: one linear, forward + backward, bf16 F.linear against fp8_linear, eager and under
   torch.compile (whose result must also match the eager fp8 path within --tol); CUDA events
   around each iteration, the median of --iters after warmup. Small
   compiled layers can be bound by the host (a compiled call's overhead), hence also:
3. One llama3-1b transformer block (trireme.models.gpt.Block, compiled as model.compile does),
   forward + backward on [--micro-batch, --seq, 2048] activations, bf16 against fp8 linears: the
   best single estimate of the training speedup (the embedding, output layer, loss and optimizer
   are the same in both, so a whole step gains somewhat less).

`--device cpu` (with `--shrink` to divide the shapes) runs the same code where this torch has a CPU
fp8 _scaled_mm: a smoke test of the script, not a measurement.

Prints a table, writes bench/results/fp8_check.json (and a copy to $OUT when set) after each part,
exits 1 if a correctness check fails (2 without a CUDA GPU with fp8, compute capability >= 8.9).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from trireme.ops.fp8 import fp8_linear  # noqa: E402

# (name, in_features K, out_features N) of one llama3-1b block: h 2048, 32 q heads and 8 kv heads
# of 64, SwiGLU ffn 8192 (fc1 holds gate and up).
LLAMA3_1B = [("qkv", 2048, 3072), ("out", 2048, 2048), ("fc1", 2048, 16384), ("fc2", 8192, 2048)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="M: tokens per matmul (b * s)")
    p.add_argument("--iters", type=int, default=20, help="timed iterations per measurement")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tol", type=float, default=1e-2, help="max rel error, fp8 vs emulation")
    p.add_argument("--no-compile", action="store_true", help="skip the torch.compile timings")
    p.add_argument("--time-budget", type=float, default=180.0,
                   help="seconds; later measurements are skipped once this is spent")
    p.add_argument("--micro-batch", type=int, default=2, help="block benchmark: batch")
    p.add_argument("--seq", type=int, default=4096, help="block benchmark: sequence length")
    p.add_argument("--no-block", action="store_true", help="skip the block benchmark")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--shrink", type=int, default=1, help="divide K and N by this (smoke tests)")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "fp8_check.json"))
    return p.parse_args(argv)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def inputs(m: int, k: int, n: int, seed: int, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16) * k**-0.5
    g = torch.randn(m, n, device=device, generator=gen, dtype=torch.bfloat16) * 1e-3
    return x, w, g


def forward_backward(fn, x, w, g) -> tuple[torch.Tensor, ...]:
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = fn(x, w)
    y.backward(g)
    return y, x.grad, w.grad


def check(m: int, k: int, n: int, seed: int, device: str) -> dict:
    x, w, g = inputs(m, k, n, seed, device)
    real = forward_backward(lambda a, b: fp8_linear(a, b), x, w, g)
    emul = forward_backward(lambda a, b: fp8_linear(a, b, emulate=True), x, w, g)
    exact = forward_backward(lambda a, b: F.linear(a.float(), b.float()), x, w, g.float())
    out = {}
    for part, r, e, f in zip(("y", "dx", "dw"), real, emul, exact, strict=True):
        out[f"{part}_vs_emulated"] = rel_err(r, e)
        out[f"{part}_vs_fp32"] = rel_err(r, f)
        out[f"{part}_finite"] = bool(torch.isfinite(r).all())
    return out


def time_it(step, warmup: int, iters: int, device: str) -> float:
    """Median milliseconds of `step()`, each iteration between two CUDA events."""
    for _ in range(warmup):
        step()
    if device == "cpu":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append(1e3 * (time.perf_counter() - t0))
        return statistics.median(times)
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 1)]
    events[0].record()
    for i in range(iters):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return statistics.median(events[i].elapsed_time(events[i + 1]) for i in range(iters))


def bench(m: int, k: int, n: int, compiled: bool, args) -> dict:
    x, w, g = inputs(m, k, n, 0, args.device)
    x.requires_grad_()
    w.requires_grad_()
    bf16 = F.linear
    fp8 = fp8_linear
    if compiled:
        bf16 = torch.compile(F.linear, dynamic=False)
        fp8 = torch.compile(fp8_linear, dynamic=False)
    result = {}
    for name, fn in (("bf16", bf16), ("fp8", fp8)):
        def step(fn=fn):
            x.grad = w.grad = None
            fn(x, w).backward(g)

        result[f"{name}_ms"] = time_it(step, args.warmup, args.iters, args.device)
    flops = 6 * m * k * n  # forward + two backward matmuls
    if compiled:  # the compiled fp8 path (inductor's fused casts) against the eager one
        ref = forward_backward(fp8_linear, x, w, g)
        got = forward_backward(fp8, x, w, g)
        result["compiled_vs_eager"] = max(rel_err(a, b) for a, b in zip(got, ref, strict=True))
        result["compiled_finite"] = all(bool(torch.isfinite(t).all()) for t in got)
    result["bf16_tflops"] = flops / result["bf16_ms"] / 1e9
    result["fp8_tflops"] = flops / result["fp8_ms"] / 1e9
    result["speedup"] = result["bf16_ms"] / result["fp8_ms"]
    return result


def bench_block(args) -> dict:
    """fwd + bwd of one compiled llama3-1b Block with bf16 linears, then with fp8 linears."""
    import copy

    from trireme.config import load_config
    from trireme.models.block import Block
    from trireme.ops.fp8_training import convert_to_float8
    from trireme.ops.rope import RotaryEmbedding, rope_frequencies
    from trireme.parallel.context import ParallelContext

    cfg = load_config("llama3-1b").model
    cfg.hidden_size //= args.shrink
    cfg.ffn_hidden_size //= args.shrink
    cfg.num_attention_heads = max(1, cfg.num_attention_heads // args.shrink)
    cfg.num_query_groups = max(1, cfg.num_query_groups // args.shrink)
    cfg.seq_length = args.seq
    torch.manual_seed(0)
    inv_freq = rope_frequencies(cfg.head_size, cfg.rope_theta, cfg.rope_scaling,
                                cfg.rope_scaling_factor, cfg.rope_low_freq_factor,
                                cfg.rope_high_freq_factor, cfg.rope_original_max_position)
    rope = RotaryEmbedding(cfg.head_size, cfg.seq_length, inv_freq)(  # inv_freq on the CPU
        torch.device(args.device), offset=0, length=args.seq)
    with torch.device(args.device):
        block = Block(cfg, ParallelContext()).to(torch.bfloat16)
        shape = (args.micro_batch, args.seq, cfg.hidden_size)
        x = torch.randn(shape, dtype=torch.bfloat16).requires_grad_()
        g = torch.randn(shape, dtype=torch.bfloat16)
    block8 = copy.deepcopy(block)
    swapped = convert_to_float8(block8)  # attention.qkv, attention.out, mlp.fc1, mlp.fc2
    result = {"shape": list(shape), "fp8_layers": swapped}
    for name, b in (("bf16", block), ("fp8", block8)):
        if args.device == "cuda":
            b.compile()

        def step(b=b):
            x.grad = None
            b(x, rope).backward(g)

        result[f"{name}_ms"] = time_it(step, args.warmup, args.iters, args.device)
    result["speedup"] = result["bf16_ms"] / result["fp8_ms"]
    return result


def write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2) + "\n"
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / path.name).write_text(text)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and (not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9)):
        print("fp8_check: needs a CUDA GPU with compute capability >= 8.9", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False  # the emulation's fp32 matmul stays fp32
    start = time.perf_counter()
    out = Path(args.out)
    data = {
        "benchmark": "fp8_check",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "tokens": args.tokens, "iters": args.iters, "tol": args.tol,
        "checks": {}, "bench": {},
    }
    m = args.tokens
    failed = False
    print(f"fp8_check on {data['device']}, torch {torch.__version__}, M = {m} tokens")
    print(f"{'layer':<6}{'K':>6}{'N':>7}   rel err vs emulated (y, dx, dW)   vs fp32 (y, dx, dW)")
    shapes = [(name, k // args.shrink, n // args.shrink) for name, k, n in LLAMA3_1B]
    for i, (name, k, n) in enumerate(shapes):
        r = check(m, k, n, i, args.device)
        worst = max(r[f"{p}_vs_emulated"] for p in ("y", "dx", "dw"))
        finite = all(r[f"{p}_finite"] for p in ("y", "dx", "dw"))
        fp8_ok = max(r[f"{p}_vs_fp32"] for p in ("y", "dx", "dw")) < 0.1
        r["pass"] = worst < args.tol and finite and fp8_ok
        failed |= not r["pass"]
        data["checks"][name] = {"K": k, "N": n, **r}
        print(f"{name:<6}{k:>6}{n:>7}   {r['y_vs_emulated']:.1e} {r['dx_vs_emulated']:.1e} "
              f"{r['dw_vs_emulated']:.1e}         {r['y_vs_fp32']:.1e} {r['dx_vs_fp32']:.1e} "
              f"{r['dw_vs_fp32']:.1e}   {'ok' if r['pass'] else 'FAIL'}")
    data["pass"] = not failed
    write(out, data)

    print(f"\n{'layer':<6}{'mode':<9}{'bf16 ms':>10}{'fp8 ms':>10}{'bf16 TF/s':>11}{'fp8 TF/s':>10}"
          f"{'speedup':>9}")
    modes = [False] if args.no_compile else [False, True]
    for compiled in modes:
        mode = "compile" if compiled else "eager"
        total = {"bf16_ms": 0.0, "fp8_ms": 0.0}
        for name, k, n in shapes:
            if time.perf_counter() - start > args.time_budget:
                print(f"(time budget spent: {mode} {name} and later skipped)")
                break
            try:
                r = bench(m, k, n, compiled, args)
            except Exception as e:  # a compile failure must not hide the eager numbers
                traceback.print_exc()
                data["bench"][f"{name}/{mode}"] = {"error": f"{type(e).__name__}: {e}"}
                failed = True
                break
            data["bench"][f"{name}/{mode}"] = r
            if compiled and not (r["compiled_vs_eager"] < args.tol and r["compiled_finite"]):
                print(f"{name}: compiled fp8 differs from eager: {r['compiled_vs_eager']:.1e}")
                failed = True
            total["bf16_ms"] += r["bf16_ms"]
            total["fp8_ms"] += r["fp8_ms"]
            print(f"{name:<6}{mode:<9}{r['bf16_ms']:>10.3f}{r['fp8_ms']:>10.3f}"
                  f"{r['bf16_tflops']:>11.0f}{r['fp8_tflops']:>10.0f}{r['speedup']:>8.2f}x")
            write(out, data)
        else:
            speedup = total["bf16_ms"] / total["fp8_ms"]
            data["bench"][f"block_linears/{mode}"] = {**total, "speedup": speedup}
            print(f"{'all 4':<6}{mode:<9}{total['bf16_ms']:>10.3f}{total['fp8_ms']:>10.3f}"
                  f"{'':>21}{speedup:>8.2f}x")
    if not args.no_block:
        try:
            r = bench_block(args)
            data["bench"]["block"] = r
            mode = "compiled" if args.device == "cuda" else "eager"
            print(f"\nllama3-1b block {r['shape']}, {mode}, fwd + bwd: bf16 "
                  f"{r['bf16_ms']:.3f} ms, fp8 {r['fp8_ms']:.3f} ms, speedup {r['speedup']:.2f}x")
        except Exception as e:
            traceback.print_exc()
            data["bench"]["block"] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
    data["pass"] = not failed
    write(out, data)
    print(f"{'PASS' if not failed else 'FAIL'}; wrote {out} ({time.perf_counter() - start:.0f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
