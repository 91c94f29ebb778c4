"""`trireme plan --calibrate`: measure this device's rate table and write it as JSON.

Measured, each the median of REPEAT calls after WARMUP untimed ones (CUDA events on a GPU; the
warm-up builds cuDNN's plans and fills the allocator): square matmuls (bf16, fp32 as trireme runs
it, no TF32; fp8 through torch._scaled_mm where it runs); causal attention forward and backward
through trireme's own op (trireme.ops.attention, backend "auto": the kernel training gets, cuDNN
on Hopper) at llama3-1b's shape (32 query heads, 8 key / value heads of size 64, sequence 4096,
the model's transposed layout), the backward timed on its own; a device-to-device copy (read +
write bytes); the transposing copies of 1-byte tensors an eager fp8 linear makes for its
backward, at llama3-1b's four linears (what trireme.plan.time's transpose_tbps prices: PyTorch's
copy kernel reads them across rows); whether RMSNorm keeps only its input and 1 / rms
(saved-tensor hooks); the device's memory. Not measured (one device cannot): the link bandwidths,
kept from the nearest published table (h200 / h100 / a100 by name, else h100) and marked so in
the description. On a device with a shipped table, a measured rate more than 2x off the table's
is printed as a warning (a broken measurement shows). On the CPU the sizes are small and the
figures rough.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trireme.ops.attention import attention
from trireme.plan.rates import Rates, load_rates

WARMUP, REPEAT = 3, 5  # untimed calls (cuDNN plans, autotuning, allocator), then timed ones
# LLAMA3_1B: the attention and fp8 linear shapes training runs (llama3-1b: 32 query heads, 8 key
# / value heads of size 64, hidden 2048, MLP 8192, sequence 4096, micro batch 4)
ATTENTION_SHAPE = dict(b=2, heads=32, kv=8, seq=4096, d=64)
LINEAR_SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # (K, M) of qkv..fc2
LINEAR_TOKENS = 4 * 4096
SANITY_RATIO = 2.0  # a measured rate this far from the shipped table's is reported


def _phases(steps: list[Callable], device: torch.device, warmup: int = WARMUP,
            repeat: int = REPEAT) -> list[float]:
    """Median seconds of each step of a chain: steps[0]() -> r0, steps[1](r0) -> r1, ...; timed
    with CUDA events on a GPU (perf_counter elsewhere) after `warmup` untimed chains."""
    cuda = device.type == "cuda"
    times: list[list[float]] = [[] for _ in steps]
    for i in range(warmup + repeat):
        marks, value = [], None
        for j, step in enumerate(steps):
            marks.append(_mark(cuda))
            value = step() if j == 0 else step(value)
        marks.append(_mark(cuda))
        if cuda:
            torch.cuda.synchronize(device)
        if i >= warmup:
            for j in range(len(steps)):
                times[j].append(_elapsed(marks[j], marks[j + 1]))
    return [statistics.median(t) for t in times]


def _mark(cuda: bool):
    if not cuda:
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _elapsed(start, end) -> float:
    if isinstance(start, float):
        return end - start
    return start.elapsed_time(end) / 1e3  # ms -> s


def _seconds(fn: Callable[[], object], device: torch.device) -> float:
    return _phases([fn], device)[0]


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int) -> float:
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    return 2 * n**3 / _seconds(lambda: a @ b, device) / 1e12


def fp8_tflops(device: torch.device, n: int) -> float | None:
    if device.type != "cuda" or not hasattr(torch, "float8_e4m3fn"):
        return None
    try:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()
        one = torch.ones((), device=device)
        run = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one,  # noqa: E731
                                       out_dtype=torch.bfloat16)
        return 2 * n**3 / _seconds(run, device) / 1e12
    except (RuntimeError, TypeError):
        return None


def attention_tflops(device: torch.device, dtype: torch.dtype, b: int, heads: int, kv: int,
                     seq: int, d: int, backend: str = "auto") -> tuple[float, float]:
    """(forward, backward) TFLOP/s of trireme's attention op (trireme.ops.attention, the kernel
    `backend` picks: cuDNN on Hopper under "auto", as in training) on a causal call laid out as
    the model lays it out: q [b, heads, seq, d], k, v [b, kv, seq, d] (GQA), transposed views of
    [b, seq, heads, d] tensors. FLOPs: 2 b heads seq^2 d forward (two matmuls, causal half),
    twice that backward; the backward timed on its own (torch.autograd.grad: no .grad
    accumulation), each the median of REPEAT after WARMUP untimed calls."""
    leaves = [torch.randn(b, seq, n, d, device=device, dtype=dtype, requires_grad=True)
              for n in (heads, kv, kv)]  # [b, seq, n, d]
    grad = torch.randn(b, seq, heads, d, device=device, dtype=dtype).transpose(1, 2)

    def forward() -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in leaves)  # [b, n, seq, d]
        return attention(q, k, v, causal=True, backend=backend)

    def backward(y: torch.Tensor) -> None:
        torch.autograd.grad(y, leaves, grad)

    fwd, bwd = _phases([forward, backward], device)
    flops = 2 * b * heads * seq * seq * d
    return flops / fwd / 1e12, 2 * flops / bwd / 1e12


def copy_tbps(device: torch.device, numel: int) -> float:
    src = torch.empty(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * 4 * numel / _seconds(lambda: dst.copy_(src), device) / 1e12


def transpose_tbps(device: torch.device, shapes: list[tuple[int, int]], tokens: int) -> float:
    """Read + write bytes/s of `t.t().contiguous()` on fp8 (else uint8) tensors: the copies an
    eager fp8 linear makes for its backward (trireme.ops.fp8), each linear (K inputs, M outputs)
    of `shapes` at `tokens` tokens: x [tokens, K], W [M, K], dL/dy [tokens, M]. All bytes over
    all the time: the rate trireme.plan.time prices FP8_TRANSPOSE_BYTES per element at."""
    dtype = getattr(torch, "float8_e4m3fn", torch.uint8)
    sizes = [s for k, m in shapes for s in ((tokens, k), (m, k), (tokens, m))]
    seconds = 0.0
    for rows, cols in sizes:
        src = torch.randn(rows, cols, device=device).to(dtype)
        seconds += _seconds(lambda src=src: src.t().contiguous(), device)
    return sum(2 * r * c for r, c in sizes) / seconds / 1e12


def sanity_warnings(measured: Rates, reference: Rates, ratio: float = SANITY_RATIO) -> list[str]:
    """One line per measured rate more than `ratio` times above or below `reference`'s (the
    shipped table of the same device): a broken measurement, or a device unlike the table's."""
    pairs = {f"matmul_tflops.{k}": (v, reference.matmul_tflops.get(k))
             for k, v in measured.matmul_tflops.items()}
    pairs |= {f"attention_tflops.{k}": (v, reference.attention_tflops.get(k))
              for k, v in measured.attention_tflops.items()}
    pairs["memory_tbps"] = (measured.memory_tbps, reference.memory_tbps)
    pairs["transpose_tbps"] = (measured.transpose_tbps, reference.transpose_tbps)
    pairs["memory_gib"] = (measured.memory_gib, reference.memory_gib)
    lines = []
    for name, (got, want) in pairs.items():
        if got and want and not 1 / ratio <= got / want <= ratio:
            lines.append(f"{name} measured {got:.4g}, {got / want:.2f}x the {reference.name} "
                         f"table's {want:.4g}: check the measurement before using this table")
    return lines


def norm_is_fused(device: torch.device) -> bool:
    """Whether F.rms_norm keeps only its input and 1 / rms (else also x / rms, in fp32)."""
    x = torch.randn(4, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(64, device=device, dtype=torch.bfloat16, requires_grad=True)
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t,
                                                  lambda t: t):
        F.rms_norm(x, (64,), w, 1e-5)
    return sum(n for n in saved if n >= x.numel()) <= x.numel() + w.numel()


def calibrate(out_path: str, device: torch.device | None = None) -> Rates:
    """Measure the table on `device` (CUDA if present), write it to `out_path` (temp name, then
    rename), return it."""
    device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if gpu else "cpu"
    matched = next((k for k in ("h200", "h100", "a100") if k in name.lower()), None)
    base_name = matched or ("h100" if gpu else "cpu")
    base = load_rates(base_name)
    n, numel = (8192, 1 << 28) if gpu else (512, 1 << 22)
    shape, shapes, tokens = ATTENTION_SHAPE, LINEAR_SHAPES, LINEAR_TOKENS
    if not gpu:  # the same kinds of call, small
        shape = dict(b=1, heads=4, kv=2, seq=256, d=64)
        shapes, tokens = [(k // 32, m // 32) for k, m in shapes], tokens // 32
    low = torch.bfloat16
    mm = {"bf16": matmul_tflops(device, low, n), "fp32": matmul_tflops(device, torch.float32, n)}
    mm["fp16"] = mm["bf16"]
    mm["fp8"] = fp8_tflops(device, n) or mm["bf16"]
    fwd, bwd = attention_tflops(device, low if gpu else torch.float32, **shape)
    memory = (torch.cuda.get_device_properties(device).total_memory / 2**30 if gpu
              else base.memory_gib)
    rates = dataclasses.replace(
        base, name=name, memory_gib=round(memory, 1), matmul_tflops=mm,
        attention_tflops={"forward": fwd, "backward": bwd}, memory_tbps=copy_tbps(device, numel),
        transpose_tbps=transpose_tbps(device, shapes, tokens),
        norm_fused=norm_is_fused(device), optimizer_fused=gpu,
        description=f"measured by `trireme plan --calibrate` on {name}; link bandwidths and "
                    f"overheads from the {base_name} table (not measured)")
    if matched:  # a table of this very device to hold the measurement against
        for line in sanity_warnings(rates, base):
            print(f"trireme plan --calibrate: warning: {line}", file=sys.stderr)
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        f.write(rates.to_json())
    os.replace(tmp, out_path)
    return rates
