"""Which slice of a full parameter each tensor-parallel rank holds, and moving between the two.

A tensor-parallel parameter is cut along one dim. Along that dim the full tensor is a concatenation
of parts, each part a run of `units` blocks of `unit_size` rows:

    fused QKV weight, dim 0     parts q: (n_heads, d), k: (n_kv, d), v: (n_kv, d)
    SwiGLU fc1 weight, dim 0    parts gate: (ffn, 1), up: (ffn, 1)
    row-parallel weight, dim 1  one part (in_features, 1)
    vocabulary, dim 0           one part (padded_vocab, 1)

Of T ranks, rank r holds units [r * units / T, r * units / T + max(units / T, 1)) of every part,
and its tensor is those slices concatenated in part order. A part with fewer units than ranks
(GQA with TP > query groups) is replicated: T / units consecutive ranks hold the same unit.

Initialization draws the full tensor for a name and keeps `shard(full)`; checkpoints and tests
`unshard` the ranks' tensors back into the full one under the global name.

The same description serves expert parallelism: the routed experts' weights [E, ...] are cut along
dim 0 over the expert group (`axis = "expert"`, one part of E units), whole experts per rank.
Each Sharding names the group axis it is cut over; code that handles the tensor-parallel kind only
asks `parameter_shardings(model, "tensor")`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class PartSlice:
    """Where one part of a sharded tensor lies: rows [full_start, +rows) of the full tensor are
    rows [local_start, +rows) of the rank's tensor, held by `replicas` ranks."""

    full_start: int
    local_start: int
    rows: int
    replicas: int


@dataclass(frozen=True)
class Sharding:
    """Rank `rank` of `size`'s slice of a full tensor along `dim` (see the module docstring)."""

    dim: int
    parts: tuple[tuple[int, int], ...]  # (units, unit_size) per part, in order
    rank: int
    size: int
    axis: str = "tensor"  # the group it is cut over: "tensor" or "expert"

    def __post_init__(self) -> None:
        for units, _ in self.parts:
            if units % self.size and self.size % units:
                raise ValueError(f"{units} units cannot be split over {self.size} ranks")

    def slices(self, rank: int | None = None) -> list[PartSlice]:
        """Each part's place in the full tensor and in `rank`'s tensor (default: this rank)."""
        rank = self.rank if rank is None else rank
        out, full_start, local_start = [], 0, 0
        for units, unit_size in self.parts:
            held = max(units // self.size, 1)
            first = rank * units // self.size
            rows = held * unit_size
            out.append(PartSlice(full_start + first * unit_size, local_start, rows,
                                 max(self.size // units, 1)))
            full_start += units * unit_size
            local_start += rows
        return out

    @property
    def full_rows(self) -> int:
        return sum(units * unit_size for units, unit_size in self.parts)

    @property
    def local_rows(self) -> int:
        return sum(s.rows for s in self.slices())

    def full_shape(self, local_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full_rows
        return tuple(shape)

    def local_shape(self, full_shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
        shape = list(full_shape)
        shape[self.dim] = self.local_rows
        return tuple(shape)

    def shard(self, full: Tensor) -> Tensor:
        """This rank's tensor, cut from the full one."""
        if full.shape[self.dim] != self.full_rows:
            raise ValueError(f"expected {self.full_rows} rows along dim {self.dim}, got "
                             f"{tuple(full.shape)}")
        pieces = [full.narrow(self.dim, s.full_start, s.rows) for s in self.slices()]
        return torch.cat(pieces, dim=self.dim).contiguous()

    def unshard(self, locals_: list[Tensor]) -> Tensor:
        """The full tensor from every rank's tensor (`locals_[r]` from rank r). Of replicas, the
        first rank's copy is taken."""
        shape = self.full_shape(locals_[0].shape)
        full = locals_[0].new_empty(shape)
        for rank, local in enumerate(locals_):
            for s in self.slices(rank):
                local_part = local.narrow(self.dim, s.local_start, s.rows)
                full.narrow(self.dim, s.full_start, s.rows).copy_(local_part)
        return full

    def views(self, local: Tensor) -> list[tuple[Tensor, int]]:
        """(view of `local`, replicas) for each part: how many ranks hold those same numbers."""
        return [(local.narrow(self.dim, s.local_start, s.rows), s.replicas) for s in self.slices()]


def even_sharding(dim: int, rows: int, rank: int, size: int, axis: str = "tensor") -> Sharding:
    """`rows` split into `size` equal runs of consecutive rows."""
    return Sharding(dim, ((rows, 1),), rank, size, axis)


def parameter_shardings(model: torch.nn.Module, axis: str | None = None) -> dict[str, Sharding]:
    """name -> Sharding of every sharded parameter of `model` (replicated ones absent); only
    those cut over `axis` ("tensor" or "expert") when it is given.

    A parallel layer lists its sharded parameters in `param_shardings()`, keyed by short name.
    """
    out = {}
    for module_name, module in model.named_modules():
        if hasattr(module, "param_shardings"):
            for short_name, sharding in module.param_shardings().items():
                if axis is None or sharding.axis == axis:
                    out[f"{module_name}.{short_name}" if module_name else short_name] = sharding
    return out


Groups = Mapping[str, dist.ProcessGroup | None]  # axis -> this rank's group along it


def gather_full(
    tensors: dict[str, Tensor], shardings: dict[str, Sharding],
    groups: Groups | dist.ProcessGroup | None,
) -> dict[str, Tensor]:
    """The full tensor for each sharded name (all-gathered over the group of its sharding's
    axis; a bare group is the tensor-parallel one), others as they are.

    Collective: every rank of the groups calls it with the same names in the same order.
    """
    if not isinstance(groups, Mapping):
        groups = {"tensor": groups}
    out = {}
    for name, t in tensors.items():
        sharding = shardings.get(name)
        group = groups.get(sharding.axis) if sharding is not None else None
        if group is None:
            out[name] = t
            continue
        parts = [torch.empty_like(t) for _ in range(sharding.size)]
        dist.all_gather(parts, t.contiguous(), group=group)
        out[name] = sharding.unshard(parts)
    return out


def shard_full(tensors: dict[str, Tensor], shardings: dict[str, Sharding]) -> dict[str, Tensor]:
    """This rank's slice of each full tensor that has a sharding; others as they are."""
    return {n: shardings[n].shard(t) if n in shardings else t for n, t in tensors.items()}
