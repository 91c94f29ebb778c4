"""A decode step whose residual adds and RMSNorms ride in its GEMMs (opt-in,
$TRIREME_DECODE_CHAIN=1, until it is measured on the GPU; trireme.inference.compiled_decode
calls it).

A llama block's decode forward after attention is, in the compiled step, five kernels: the out
projection, an add + norm, the gate-up GEMM with SwiGLU, the down projection, an add + norm (the
next block's input norm). With trireme.ops.skinny_fused it is three:

    x1, s1 = skinny_residual(y, W_out, x)          x1 = x + out(y), s1 its sums of squares
    a      = skinny_normed(x1, s1, mlp_norm, W_fc1)  silu(gate) * up of rmsnorm(x1)
    x2, s2 = skinny_residual(a, W_fc2, x1)          x2 = x1 + down(a)

and the next block's attention takes Squares(x2, s2) in place of its input norm: with its qkv
on a split plan (e.g. TRIREME_SKINNY_SPLITS=3072x2048:4) `skinny_normed` makes the qkv planes
that the paged kernel sums and rotates (compiled_decode's raw inputs), else its compiled `pre`
norms x2 itself. A block that does not have this shape (another MLP, LayerNorm, biases, QK-norm
for the qkv half, a layer without a split plan, more rows than the kernels take) keeps the
compiled pieces. These run eagerly (their ops are single kernels; inside the CUDA graphs their
launches cost nothing).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from trireme.ops import skinny_gemm
from trireme.ops.norms import RMSNorm
from trireme.ops.skinny_fused import COUNTERS, residual_fits, skinny_normed, skinny_residual

ENV = "TRIREME_DECODE_CHAIN"


class Squares(NamedTuple):
    """A chained post's hand-on to the next attention piece: the residual stream x [1, T, h]
    and its per-tile sums of squares [tiles, T] (trireme.ops.skinny_fused)."""

    x: torch.Tensor
    sumsq: torch.Tensor


def _rms(norm: Any) -> tuple[torch.Tensor, float] | None:
    """(weight, eps) of a plain RMSNorm (not liger's), else None."""
    if type(norm) is RMSNorm and not norm.liger:
        return norm.weight, norm.eps
    return None


def _split(layer: Any, x: torch.Tensor) -> int | None:
    """The split-K plan of a bias-free SkinnyLinear with more than one split, for an input of
    x's rows, dtype and device (skinny_gemm.usable reads no more of x than that)."""
    if not isinstance(layer, skinny_gemm.SkinnyLinear) or layer.bias is not None:
        return None
    splits = skinny_gemm.usable(x, layer.weight)
    return splits if splits is not None and splits > 1 else None


def post_plan(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor | None,
              attended: str | None, names: tuple[str, ...]) -> tuple | None:
    """(out splits, down splits, the MLP's norm (weight, eps)) when the piece "x + out(y),
    then x + mlp(norm(x))" fits the chained kernels, else None."""
    if attended is None or y is None or len(names) != 1:
        return None
    mlp = getattr(block, names[0])
    norm = _rms(getattr(block, f"{names[0]}_norm"))
    fc1, fc2 = getattr(mlp, "fc1", None), getattr(mlp, "fc2", None)
    out = getattr(block, attended).out
    rows = x[0]
    if norm is None or not getattr(mlp, "swiglu", False) or fc1 is None or fc1.bias is not None:
        return None
    if not isinstance(fc1, skinny_gemm.SkinnyLinear) or not skinny_gemm.glu_usable(
            rows, fc1.weight):
        return None
    splits = _split(out, rows), _split(fc2, rows)
    if None in splits or not all(residual_fits(layer.weight, rows.shape[0], s, COUNTERS)
                                 for layer, s in zip((out, fc2), splits)):
        return None
    return (*splits, norm)


def chained_post(block: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, attended: str,
                 names: tuple[str, ...], plan: tuple, counters: torch.Tensor
                 ) -> tuple[torch.Tensor, Squares]:
    """x [1, T, h] + out(y), then + mlp(norm(...)) through the fused ops (module docstring):
    (x2 [1, T, h], Squares(x2, its sums of squares))."""
    out_splits, down_splits, (g, eps) = plan
    mlp = getattr(block, names[0])
    x1, s1 = skinny_residual(y.flatten(1), getattr(block, attended).out.weight, out_splits,
                             x[0], counters)
    act = skinny_normed(x1, s1, g, eps, mlp.fc1.weight, 1, True)
    x2, s2 = skinny_residual(act, mlp.fc2.weight, down_splits, x1, counters)
    x2 = x2.unsqueeze(0)
    return x2, Squares(x2, s2)


def normed_qkv(block: torch.nn.Module, name: str, carried: Squares
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """The attention sublayer `name`'s raw q, k, v planes (compiled_decode._project_raw's
    layout) of rmsnorm(carried.x) through skinny_normed, or None when it does not fit (QK-norm,
    another norm, no split plan for its qkv)."""
    attention = getattr(block, name)
    norm = _rms(getattr(block, f"{name}_norm"))
    rows = carried.x[0]
    splits = None if attention.qk_norm or norm is None else _split(attention.qkv, rows)
    if splits is None:
        return None
    return qkv_views(attention, skinny_normed(rows, carried.sumsq, *norm, attention.qkv.weight,
                                              splits, False))


def qkv_views(attention: torch.nn.Module, planes: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [S, T, n_heads, d], k, v [S, T, n_kv, d]: views of an attention sublayer's qkv
    projection as planes [S, T, (n_heads + 2 n_kv) d] (the paged kernel's raw inputs)."""
    n_heads, n_kv, d = attention.num_heads, attention.num_kv_heads, attention.head_size
    q = planes[..., : n_heads * d].unflatten(-1, (n_heads, d))
    k = planes[..., n_heads * d : (n_heads + n_kv) * d].unflatten(-1, (n_kv, d))
    v = planes[..., (n_heads + n_kv) * d :].unflatten(-1, (n_kv, d))
    return q, k, v
