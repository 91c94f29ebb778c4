"""A decode step's attention inputs as the compiled decode step hands them to the paged kernel
(trireme.ops.paged_attention's `rope` and planes), and the plain torch way to make them what the
kernel's reference takes.

The qkv projection of a decode step may come as planes: [S, r, heads, d], S partial products of
a split-K GEMM (trireme.ops.skinny_gemm, fp32) whose sum, rounded once, is the projection (S = 1:
the projection itself, in the pools' dtype; a 3-D tensor is one plane). And with `rope`
(cos, sin [r, d], fp32: each request's position) q and k are not yet rotated. The kernel sums the
planes, rotates and rounds as it loads them, so neither the sum nor RoPE is a kernel of its own;
`prepared` does the same in torch, in the same order:

    x = sum_s planes[s]  (fp32, s = 0, 1, ...), rounded to the pools' dtype
    x = rope(x)          (trireme.ops.rope: fp32, rounded again), for q and k only
"""

from __future__ import annotations

import torch

from trireme.ops.rope import apply_rotary_heads

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [r, d] fp32


def summed(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[r, heads, d] in `dtype`: x's planes [S, r, heads, d] summed in order in fp32 and rounded
    once (a 3-D x is one plane: only cast)."""
    if x.dim() == 3:
        return x.to(dtype)
    total = x[0].float()
    for s in range(1, x.shape[0]):
        total = total + x[s]
    return total.to(dtype)


def prepared(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rope: Rope | None,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [r, n_heads, d], k, v [r, n_kv, d] in `dtype` from planes (or 3-D tensors), q and k
    rotated by `rope` when given (module docstring)."""
    q, k, v = (summed(t, dtype) for t in (q, k, v))
    if rope is not None:
        q, k = (apply_rotary_heads(t, *rope) for t in (q, k))
    return q, k, v


def check_rope(rope: Rope | None, rows: int, d: int) -> Rope | None:
    """rope as cos, sin [rows, d] fp32 with unit column stride (the kernel's addressing), or
    None; a one-line error for anything else."""
    if rope is None:
        return None
    cos, sin = (t.reshape(-1, t.shape[-1]) for t in rope)
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (rows, d) or t.dtype != torch.float32:
            raise ValueError(f"rope {name} is {tuple(t.shape)} {t.dtype}; it must be "
                             f"[{rows}, {d}] float32, one row per request")
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))  # type: ignore
