"""The decode step's residual adds and RMSNorms inside its split-K GEMMs (trireme.ops.skinny_gemm):
two ops for a pre-norm block's sublayers, x' = x + f(rmsnorm(x)), of few rows.

    new, sumsq = skinny_residual(a, W, splits, x, counters)
        new = x + a W^T                    the product rounded once, then the add, rounded
        sumsq[t, m] = sum over columns n of tile t (RESIDUAL_TILE_N wide) of new[m, n]^2 (fp32)

    y = skinny_normed(x, sumsq, g, eps, W, splits, glu)
        h = rmsnorm(x) = x rstd g          rstd = 1 / sqrt(sum_t sumsq[t] / K + eps), in fp32,
                                           rounded once (Inductor's RMSNorm)
        y = h W^T as skinny_mm's planes [splits, M, N] (glu: [M, F], silu(gate) * up)

so a block's residual add and the next sublayer's norm are no kernels of their own: the sums of
squares come out of the kernel that made `new` (the last of its splits to finish adds the
partials: trireme.ops.skinny_gemm_triton's RESIDUAL), and the next GEMM norms its input as it
loads it (NORM). `counters` is an int32 buffer of zeros (at least `counters_needed` of them)
that the kernel uses as its tiles' semaphores and leaves at zero,
but it is declared mutated (it writes it while it runs); two launches must not share it at the
same time (one stream). On CUDA the Triton kernel; elsewhere, and as the reference, the same
math in torch.
"""

from __future__ import annotations

import torch

from trireme.ops.skinny_gemm import (
    GLU_TILES,
    _by_rows,
    _launcher,
    skinny_mm_reference,
    skinny_swiglu_reference,
    tile_for,
)

RESIDUAL_TILE_N = 64  # columns per sumsq tile: the block_n of every planned split tile
COUNTERS = 1024  # the semaphores a caller allocates: N / 64 tiles x 4 row tiles, N <= 16384


def counters_needed(n: int, rows: int) -> int:
    """Semaphores a skinny_residual launch of `rows` rows and N = n takes at most (row tiles
    of 16 rows at the least)."""
    return (n // RESIDUAL_TILE_N) * -(-rows // 16)


def residual_fits(weight: torch.Tensor, rows: int, splits: int, counters: int) -> bool:
    """Whether skinny_residual's kernel takes weight [N, K] at `rows` rows and `splits`: its
    tile RESIDUAL_TILE_N wide, and `counters` semaphores enough."""
    n, k = weight.shape
    return (tile_for(rows, n, k, splits)[0].block_n == RESIDUAL_TILE_N
            and counters_needed(n, rows) <= counters)


def residual_reference(a: torch.Tensor, weight: torch.Tensor, splits: int, x: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(new, sumsq) of the module docstring in torch."""
    part = skinny_mm_reference(a, weight, splits)
    y = part[0]
    for s in range(1, part.shape[0]):
        y = y + part[s]
    new = x + y.to(x.dtype)
    squares = new.float().square().unflatten(1, (-1, RESIDUAL_TILE_N)).sum(-1)  # [M, tiles]
    return new, squares.t().contiguous()


def normed_reference(x: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
    """rmsnorm(x) from the per-tile sums of squares (module docstring), rounded once."""
    rstd = torch.rsqrt(sumsq.sum(0) / x.shape[1] + eps)[:, None]
    return (x.float() * rstd * norm_weight.float()).to(x.dtype)


@torch.library.custom_op("trireme::skinny_residual", mutates_args=("counters",),
                         schema="(Tensor a, Tensor weight, int splits, Tensor x, "
                                "Tensor(a!) counters) -> (Tensor, Tensor)")
def skinny_residual(a: torch.Tensor, weight: torch.Tensor, splits: int, x: torch.Tensor,
                    counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(new [M, N], sumsq [N / RESIDUAL_TILE_N, M] fp32) for a [M, K], weight [N, K], x [M, N]
    (module docstring): the Triton kernel on CUDA, this reference elsewhere."""
    return residual_reference(a, weight, splits, x)


@skinny_residual.register_fake
def _(a, weight, splits, x, counters):
    n = weight.shape[0]
    return x.new_empty(a.shape[0], n), x.new_empty(n // RESIDUAL_TILE_N, a.shape[0],
                                                   dtype=torch.float32)


@skinny_residual.register_kernel("cuda")
def _(a, weight, splits, x, counters):
    launch = _launcher()
    if launch is None:
        return residual_reference(a, weight, splits, x)
    n, k = weight.shape
    tile, block_m = tile_for(a.shape[0], n, k, splits)
    if tile.block_n != RESIDUAL_TILE_N:
        raise ValueError(f"skinny_residual: the plan for {n} x {k} tiles {tile.block_n} "
                         f"columns; its sums of squares need {RESIDUAL_TILE_N}")
    x = x if x.is_contiguous() else x.contiguous()
    new = x.new_empty(x.shape)
    sumsq = x.new_empty(n // tile.block_n, a.shape[0], dtype=torch.float32)
    launch(a, weight, splits, tile.block_n, tile.block_k, block_m, tile.swap, tile.num_warps,
           tile.num_stages, residual=(x, new, sumsq, counters))
    return new, sumsq


@torch.library.custom_op("trireme::skinny_normed", mutates_args=(),
                         schema="(Tensor x, Tensor sumsq, Tensor norm_weight, float eps, "
                                "Tensor weight, int splits, bool glu) -> Tensor")
def skinny_normed(x: torch.Tensor, sumsq: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                  weight: torch.Tensor, splits: int, glu: bool) -> torch.Tensor:
    """rmsnorm(x) W^T as planes [splits, M, N] (glu: silu(gate) * up [M, F]) from x [M, K]
    and its per-tile sums of squares (module docstring): Triton on CUDA, else this."""
    return _normed_torch(x, sumsq, norm_weight, eps, weight, splits, glu)


def _normed_torch(x, sumsq, norm_weight, eps, weight, splits, glu):
    h = normed_reference(x, sumsq, norm_weight, eps)
    return skinny_swiglu_reference(h, weight) if glu else skinny_mm_reference(h, weight, splits)


@skinny_normed.register_fake
def _(x, sumsq, norm_weight, eps, weight, splits, glu):
    if glu:
        return x.new_empty(x.shape[0], weight.shape[0] // 2)
    dtype = torch.float32 if splits > 1 else x.dtype
    return x.new_empty(splits, x.shape[0], weight.shape[0], dtype=dtype)


@skinny_normed.register_kernel("cuda")
def _(x, sumsq, norm_weight, eps, weight, splits, glu):
    launch = _launcher()
    if launch is None:
        return _normed_torch(x, sumsq, norm_weight, eps, weight, splits, glu)
    n, k = weight.shape
    if glu:
        tile, block_m = _by_rows(GLU_TILES[(n, k)], x.shape[0])
    else:
        tile, block_m = tile_for(x.shape[0], n, k, splits)
    out = launch(x, weight, splits, tile.block_n, tile.block_k, block_m, tile.swap,
                 tile.num_warps, tile.num_stages, glu=glu, norm=(sumsq, norm_weight, eps))
    return out[0] if glu else out
