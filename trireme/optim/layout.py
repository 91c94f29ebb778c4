"""The flat gradient (and master-weight) buffer's layout: where each parameter sits, cut into
buckets of whole parameters in the order the backward finishes them (trireme.step.data_parallel
reduces them over the data-parallel replicas; at DP = 1 it is one bucket in model order)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

# Each parameter's slice starts at a multiple of this many elements (256 bytes of fp32), so the
# multi-tensor kernels of AdamW and the collectives get aligned pointers.
ALIGN = 64


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Bucket:
    """A contiguous range [start, end) of the flat buffer holding the parameters `params`
    (indices into the optimizer's parameter list), reduced over the group `axis` of `shards`
    ranks (0: the layout's DP degree); end - start is a multiple of that. Expert-parallel
    experts' buckets are reduced over "expert_data", the rest over "data_context"."""

    start: int
    end: int
    params: tuple[int, ...]
    axis: str = "data_context"
    shards: int = 0

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class GradLayout:
    """Where each parameter sits in the flat buffers, and the buckets (in reduction order)."""

    offsets: tuple[int, ...]
    total: int
    buckets: tuple[Bucket, ...]
    data_parallel: int = 1

    def shard_ranges(self, rank: int | Mapping[str, int]) -> list[tuple[int, int]]:
        """[start, end) of this rank's chunk of each bucket: its optimizer shard. `rank`: its
        rank in each bucket's group, by axis (a number: the same in every group)."""
        out = []
        for b in self.buckets:
            r = rank if isinstance(rank, int) else rank[b.axis]
            chunk = b.numel // (b.shards or self.data_parallel)
            out.append((b.start + r * chunk, b.start + (r + 1) * chunk))
        return out


def grad_layout(numels: Sequence[int], bucket_size: int = 0, data_parallel: int = 1) -> GradLayout:
    """The flat-buffer layout of parameters with `numels` elements (in model order).

    `bucket_size` <= 0 gives one bucket in model order: the single-process layout. Otherwise
    (at DP = 1 too, which only benchmarks of the DP path ask for) parameters are taken from the
    last to the first (the order backward finishes them) into buckets of at least `bucket_size`
    elements; each bucket is padded to a multiple of ALIGN * DP so every DP chunk is aligned and
    equal.
    """
    order = list(range(len(numels)))
    groups: list[list[int]] = []
    if bucket_size <= 0:
        groups = [order]
    else:
        current: list[int] = []
        filled = 0
        for i in reversed(order):
            current.append(i)
            filled += _round_up(numels[i], ALIGN)
            if filled >= bucket_size:
                groups.append(current)
                current, filled = [], 0
        if current:
            groups.append(current)
    offsets = [0] * len(numels)
    buckets, total = [], 0
    for group in groups:
        start = total
        for i in group:
            offsets[i] = total
            total += _round_up(numels[i], ALIGN)
        total = start + _round_up(total - start, ALIGN * data_parallel)
        buckets.append(Bucket(start, total, tuple(group)))
    return GradLayout(tuple(offsets), total, tuple(buckets), data_parallel)
