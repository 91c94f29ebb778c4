"""Where this rank's tensors lie in the global (single-process) tensors: rectangles.

A sharded checkpoint stores every tensor under its global name and global shape, so it does not
depend on the layout that wrote it. Each rank describes what it holds as `Piece`s: a view of its
local data and the offsets of that view in the global tensor. One local tensor can be several
pieces:

- a tensor-parallel weight is one piece per part of its `Sharding` (the fused qkv: this rank's
  q rows, k rows and v rows, three row blocks of the global qkv; SwiGLU fc1: gate and up rows; a
  row-parallel weight: one column block);
- a distributed-optimizer segment (a flat range [lo, hi) of the local parameter) is up to three
  rectangles of the local tensor (the partial first row, the full rows, the partial last row),
  each then cut by the tensor-parallel parts as above;
- the vocabulary tables are stored with the single-process padding: rows beyond it (the extra
  tensor-parallel padding, always zero) are left out.

Replicated pieces (data-parallel replicas, GQA key/value heads repeated over TP ranks, the tied
embedding on the last pipeline stage) have the same global offsets on every holder, and
torch.distributed.checkpoint writes them once. Loading builds the same description for the
layout that runs now and copies the overlapping parts of the stored chunks into the views.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.distributed.tensor import Shard

from trireme.parallel.sharding import Sharding


@dataclass
class Piece:
    """`data` (a view of live or staged memory) is the block at `offsets` of the global tensor."""

    data: Tensor
    offsets: tuple[int, ...]


@dataclass
class Entry:
    """One global tensor: its global shape and dtype, and the pieces this rank holds."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: list[Piece] = field(default_factory=list)


def local_rectangles(data: Tensor, shape: tuple[int, ...], lo: int, hi: int
                     ) -> list[tuple[Tensor, tuple[int, ...]]]:
    """(view, offsets in the local tensor) of the flat range [lo, hi) of a tensor of `shape`;
    `data` is that range, flat. Whole rows (slices along dim 0) where the range covers them,
    the partial first and last rows cut the same way one dimension down."""
    if hi <= lo:
        return []
    if len(shape) == 1:
        return [(data, (lo,))]
    inner = math.prod(shape[1:])
    first, last = -(-lo // inner), hi // inner  # the whole rows [first, last)
    if first > last:  # inside one row
        row = lo // inner
        return _in_row(data, shape, row, lo - row * inner, hi - row * inner)
    out = _in_row(data[: first * inner - lo], shape, first - 1, lo - (first - 1) * inner, inner)
    whole = data[first * inner - lo : last * inner - lo]
    if last > first:
        out.append((whole.view(last - first, *shape[1:]), (first,) + (0,) * (len(shape) - 1)))
    return out + _in_row(data[last * inner - lo :], shape, last, 0, hi - last * inner)


def _in_row(data: Tensor, shape: tuple[int, ...], row: int, lo: int, hi: int
            ) -> list[tuple[Tensor, tuple[int, ...]]]:
    """The rectangles of the flat range [lo, hi) of row `row` (a tensor of shape[1:])."""
    return [(view.unsqueeze(0), (row, *at))
            for view, at in local_rectangles(data, tuple(shape[1:]), lo, hi)]


def to_global(view: Tensor, offsets: tuple[int, ...], sharding: Sharding | None,
              shape: tuple[int, ...]) -> list[Piece]:
    """The pieces of the global tensor (of `shape`) that a block of the local tensor holds."""
    blocks = [(view, offsets)]
    if sharding is not None:
        d, blocks = sharding.dim, []
        start, size = offsets[d], view.shape[d]
        for part in sharding.slices():
            a = max(start, part.local_start)
            b = min(start + size, part.local_start + part.rows)
            if a < b:
                at = list(offsets)
                at[d] = part.full_start + a - part.local_start
                blocks.append((view.narrow(d, a - start, b - a), tuple(at)))
    pieces = []
    for block, at in blocks:  # rows beyond the global shape: extra vocabulary padding
        keep = min(block.shape[0], shape[0] - at[0])
        if keep > 0:
            pieces.append(Piece(block.narrow(0, 0, keep), at))
    return pieces


def tensor_pieces(data: Tensor, local_shape: tuple[int, ...], sharding: Sharding | None,
                  shape: tuple[int, ...], flat_range: tuple[int, int] | None = None
                  ) -> list[Piece]:
    """The pieces of a local tensor (`flat_range`: `data` is only that flat range of it)."""
    if flat_range is None:
        rects = [(data.view(local_shape), (0,) * len(local_shape))]
    else:
        rects = local_rectangles(data.reshape(-1), tuple(local_shape), *flat_range)
    return [p for view, at in rects for p in to_global(view, at, sharding, shape)]



def dtensor_pieces(t) -> list[Piece]:
    """The local shard of an FSDP parameter (a DTensor sharded on dim 0 over a 1-D mesh, split
    the way torch.chunk splits: ceil(rows / ranks) rows each, the last ones shorter or empty)."""

    if len(t.placements) != 1 or t.placements[0] != Shard(0):
        raise ValueError(f"sharded checkpoints handle DTensors sharded on dim 0 only, got "
                         f"{t.placements}")
    local = t.to_local().detach()
    rows, ranks = t.shape[0], t.device_mesh.size()
    start = min(rows, t.device_mesh.get_local_rank() * -(-rows // ranks))
    if local.shape[0] != min(rows - start, -(-rows // ranks)):
        raise ValueError(f"unexpected FSDP shard of {tuple(local.shape)} rows at {start} of "
                         f"{tuple(t.shape)}")
    return [Piece(local, (start,) + (0,) * (t.dim() - 1))] if local.numel() else []
