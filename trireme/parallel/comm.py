"""Tensor-parallel communication as autograd functions: each one's forward and backward are a pair.

Notation: T ranks in the tensor-parallel group, rank r holds x_r; activations are [b, s, h], so the
sequence is dim 1. In Megatron-LM's paper (Shoeybi et al., 2019) `f` and `g` are the conjugate pair
around a tensor-parallel MLP or attention block:

    f  (copy_to_tensor_parallel)      forward  y_r = x                 backward  dx = sum_r dy_r
    g  (reduce_from_tensor_parallel)  forward  y = sum_r x_r           backward  dx_r = dy

With sequence parallelism (Korthikanti et al., 2022) the residual stream is split along the
sequence, and f / g become an all-gather / reduce-scatter pair along dim 1:

    gather_sequence          forward  y = [x_0; ...; x_{T-1}]   backward  dx_r = (sum_r' dy_r')_r
    reduce_scatter_sequence  forward  y_r = (sum_r' x_r')_r     backward  dx = [dy_0; ...; dy_{T-1}]

where (z)_r is chunk r of z along the sequence. `gather_last_dim` collects vocabulary-split logits
(backward: each rank keeps its own slice of the gradient). A mixture-of-experts layer without
sequence parallelism cuts its tokens among the ranks and joins them again:

    split_rows   forward  y_r = (x)_r along dim 0                 backward  dx = [dy_0; ...]
    gather_rows  forward  y = [x_0; ...; x_{T-1}] along dim 0     backward  dx_r = (dy)_r

Every function takes the group and its size explicitly; none reads global state.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed the tensor collectives (the old names warn); 2.11 has only the old ones.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_reduce(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    dist.all_reduce(x, group=group)
    return x


def _gather_dim1(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """[b, s, ...] on each rank -> [b, size * s, ...], rank r's block at sequence chunk r."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)  # [size * b, s, ...]: rank r's x at rows r*b..
    out = out.view(size, *x.shape).transpose(0, 1)  # [b, size, s, ...]
    return out.reshape(x.shape[0], size * x.shape[1], *x.shape[2:])  # no copy when b == 1


def _reduce_scatter_dim1(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """[b, size * s, ...] on each rank -> the sum over ranks of sequence chunk r, [b, s, ...]."""
    b, s_full = x.shape[:2]
    s = s_full // size
    chunks = x.reshape(b, size, s, *x.shape[2:]).transpose(0, 1).contiguous()  # [size, b, s, ...]
    out = x.new_empty((b, s, *x.shape[2:]))
    _reduce_scatter_single(out, chunks.view(size * b, s, *x.shape[2:]), group=group)
    return out


def _gather_last(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """[..., n] on each rank -> [..., size * n], rank r's slice at columns r*n..(r+1)*n."""
    x = x.contiguous()
    out = x.new_empty((size * x.shape[0], *x.shape[1:]))
    _all_gather_single(out, x, group=group)  # rank r's x at rows r * x.shape[0]..
    out = out.view(size, *x.shape)  # [size, ..., n]
    return out.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


class _CopyToTensorParallel(torch.autograd.Function):
    """f: y_r = x (identity); dx = sum_r dy_r (all-reduce of the gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        # dy is the fresh gradient of a column-parallel matmul's input, held by nothing else, so
        # it is reduced in place.
        return _all_reduce(dy.contiguous(), ctx.group), None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g: y = sum_r x_r (all-reduce); dx_r = dy (identity)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        # x is the output of this rank's row-parallel matmul (or embedding lookup), used by no
        # one else: reduced in place.
        ctx.mark_dirty(x)
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None]:
        return dy, None


class _GatherSequence(torch.autograd.Function):
    """y = [x_0; ...; x_{T-1}] along dim 1 (all-gather); dx_r = chunk r of sum_r' dy_r'
    (reduce-scatter: the consumer is column-parallel, so each rank's dy is a partial sum)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
        ctx.group, ctx.size = group, size
        return _gather_dim1(x, group, size)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None]:
        return _reduce_scatter_dim1(dy, ctx.group, ctx.size), None, None


class _ReduceScatterSequence(torch.autograd.Function):
    """y_r = chunk r of sum_r' x_r' along dim 1 (reduce-scatter); dx = [dy_0; ...; dy_{T-1}]
    (all-gather)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
        ctx.group, ctx.size = group, size
        return _reduce_scatter_dim1(x, group, size)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None]:
        return _gather_dim1(dy, ctx.group, ctx.size), None, None


class _GatherLastDim(torch.autograd.Function):
    """y = [x_0, ..., x_{T-1}] along the last dim (all-gather); dx_r = slice r of dy (no
    communication: every rank holds the same dy)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int, rank: int) -> Tensor:
        ctx.width, ctx.rank = x.shape[-1], rank
        return _gather_last(x, group, size)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None, None]:
        start = ctx.rank * ctx.width
        return dy[..., start : start + ctx.width].contiguous(), None, None, None


def copy_to_tensor_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return _CopyToTensorParallel.apply(x, group)


def reduce_from_tensor_parallel(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """g: all-reduce forward (in place on `x`, which must not be used elsewhere), identity
    backward."""
    return _ReduceFromTensorParallel.apply(x, group)


def gather_sequence(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """[b, s / T, h] sequence shards -> [b, s, h]; reduce-scatter of the gradient backward."""
    return _GatherSequence.apply(x, group, size)


def reduce_scatter_sequence(x: Tensor, group: dist.ProcessGroup, size: int) -> Tensor:
    """[b, s, h] partial sums -> this rank's [b, s / T, h] shard of their sum; all-gather of the
    gradient backward."""
    return _ReduceScatterSequence.apply(x, group, size)


def gather_last_dim(x: Tensor, group: dist.ProcessGroup, size: int, rank: int) -> Tensor:
    """[..., n] slices -> [..., T * n]; each rank keeps its slice of the gradient backward."""
    return _GatherLastDim.apply(x, group, size, rank)


class _SplitRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int, rank: int) -> Tensor:
        ctx.group, ctx.size = group, size
        return x.chunk(size)[rank].contiguous()

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None, None]:
        return _gather_dim1(dy.unsqueeze(0), ctx.group, ctx.size).squeeze(0), None, None, None


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, size: int, rank: int) -> Tensor:
        ctx.size, ctx.rank = size, rank
        return _gather_dim1(x.unsqueeze(0), group, size).squeeze(0)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None, None]:
        return dy.chunk(ctx.size)[ctx.rank].contiguous(), None, None, None


def split_rows(x: Tensor, group: dist.ProcessGroup, size: int, rank: int) -> Tensor:
    """Rank r's chunk r of `x` (equal on every rank) along dim 0; all-gather backward."""
    return _SplitRows.apply(x, group, size, rank)


def gather_rows(x: Tensor, group: dist.ProcessGroup, size: int, rank: int) -> Tensor:
    """Every rank's `x` joined along dim 0; each rank keeps its chunk of the gradient."""
    return _GatherRows.apply(x, group, size, rank)
