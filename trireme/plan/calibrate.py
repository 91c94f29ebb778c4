"""`trireme plan --calibrate`: measure this device's rate table and write it as JSON.

Measured: square matmuls (bf16, fp32; fp8 through torch._scaled_mm where it runs), causal
scaled-dot-product attention forward and backward (head size 64, the FLOPs of the causal half),
a device-to-device copy (read + write bytes), a copy of a transposed 1-byte tensor (what eager
fp8 pays for its backward layouts: PyTorch's copy kernel reads it across rows), whether RMSNorm
keeps only its input and 1 / rms (saved-tensor hooks), and the device's memory. Not measured
(one device cannot): the link bandwidths, kept from the nearest published table (h200 / h100 /
a100 by name, else h100) and marked so in the description. On the CPU the sizes are small and
the figures rough.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from trireme.plan.rates import Rates, load_rates


def _seconds(fn: Callable[[], object], device: torch.device, repeat: int = 5) -> float:
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeat


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


def attention_tflops(device: torch.device, dtype: torch.dtype, seq: int) -> tuple[float, float]:
    b, heads, d = 2, 16, 64
    q, k, v = (torch.randn(b, heads, seq, d, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))
    flops = 2 * 2 * b * heads * seq * seq * d / 2  # two matmuls, causal half
    fwd = _seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), device)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(out)

    def both() -> None:
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(y, grad)

    bwd = max(_seconds(both, device) - fwd, 1e-9)
    return flops / fwd / 1e12, 2 * flops / bwd / 1e12


def copy_tbps(device: torch.device, numel: int) -> float:
    src = torch.empty(numel, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    return 2 * 4 * numel / _seconds(lambda: dst.copy_(src), device) / 1e12


def transpose_tbps(device: torch.device, n: int) -> float:
    """Read + write bytes/s of `t.t().contiguous()` for an fp8 (else uint8) [n, n] tensor."""
    dtype = getattr(torch, "float8_e4m3fn", torch.uint8)
    src = torch.randn(n, n, device=device).to(dtype)
    return 2 * n * n / _seconds(lambda: src.t().contiguous(), device) / 1e12


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
    base_name = next((k for k in ("h200", "h100", "a100") if k in name.lower()),
                     "h100" if gpu else "cpu")
    base = load_rates(base_name)
    n, seq, numel = (8192, 4096, 1 << 28) if gpu else (512, 256, 1 << 22)
    low = torch.bfloat16
    mm = {"bf16": matmul_tflops(device, low, n), "fp32": matmul_tflops(device, torch.float32, n)}
    mm["fp16"] = mm["bf16"]
    mm["fp8"] = fp8_tflops(device, n) or mm["bf16"]
    fwd, bwd = attention_tflops(device, low if gpu else torch.float32, seq)
    memory = (torch.cuda.get_device_properties(device).total_memory / 2**30 if gpu
              else base.memory_gib)
    rates = dataclasses.replace(
        base, name=name, memory_gib=round(memory, 1), matmul_tflops=mm,
        attention_tflops={"forward": fwd, "backward": bwd}, memory_tbps=copy_tbps(device, numel),
        transpose_tbps=transpose_tbps(device, n * 2 if gpu else n),
        norm_fused=norm_is_fused(device), optimizer_fused=gpu,
        description=f"measured by `trireme plan --calibrate` on {name}; link bandwidths and "
                    f"overheads from the {base_name} table (not measured)")
    tmp = f"{out_path}.tmp"
    with open(tmp, "w") as f:
        f.write(rates.to_json())
    os.replace(tmp, out_path)
    return rates
