"""Tensor parallelism (and sequence parallelism): the layers, and what they share.

A transformer block splits across T ranks with one all-reduce per sublayer in each direction
(Megatron-LM): the first matrix of the MLP and the fused QKV projection are split by output features
("column parallel": rank r computes heads / features r), the second by input features ("row
parallel": each rank's product is a partial sum of the output). So

    attention:  x -f-> [qkv_r = x W_qkv,r] -> attention over local heads -> [y_r W_out,r] -g-> sum
    MLP:        x -f-> [h_r = act(x W_fc1,r)] -> [h_r W_fc2,r] -g-> sum

with f and g from comm.py. Query heads are split evenly; key/value heads too, or, when T exceeds
the query groups (GQA), each group's K/V head is replicated on the T / groups ranks that hold its
query heads. SwiGLU's gate and up are split alike, so silu(gate_r) * up_r needs no communication.

Sequence parallelism (`parallel.sequence_parallel`) splits the residual stream between the blocks
along the sequence: norms and dropout run on [b, s / T, h] shards, f becomes an all-gather along the
sequence and g a reduce-scatter (the same traffic as one all-reduce, and activations T times
smaller). Parameters outside the split matrices (norm weights, biases after g) then see only their
rank's tokens, so their gradients are summed over the group before the optimizer step (grads.py).

At T = 1 the factories here return the ordinary torch layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trireme.config import ModelConfig
from trireme.errors import ConfigError
from trireme.parallel.comm import (
    copy_to_tensor_parallel,
    gather_sequence,
    reduce_from_tensor_parallel,
    reduce_scatter_sequence,
)
from trireme.parallel.mesh import ParallelMesh
from trireme.parallel.random import TensorParallelRNG
from trireme.parallel.sharding import Sharding, even_sharding


@dataclass
class TensorParallel:
    """What tensor-parallel layers share: the group, this rank, sequence parallelism, the RNG.

    `replica_groups[n]` is the group of n consecutive TP ranks holding the same replicated
    key/value head (only when T > query groups).
    """

    group: dist.ProcessGroup
    size: int
    rank: int
    sequence_parallel: bool
    rng: TensorParallelRNG
    replica_groups: dict[int, dist.ProcessGroup | None] = field(default_factory=dict)

    def to_full_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The input of a column-parallel matmul: f, or the all-gather of the sequence shards."""
        if self.sequence_parallel:
            return gather_sequence(x, self.group, self.size)
        return copy_to_tensor_parallel(x, self.group)

    def reduce_partial_sums(self, x: torch.Tensor) -> torch.Tensor:
        """The output of a row-parallel matmul (or an embedding): g, or the reduce-scatter to
        this rank's sequence shard."""
        if self.sequence_parallel:
            return reduce_scatter_sequence(x, self.group, self.size)
        return reduce_from_tensor_parallel(x, self.group)

    def sequence_shard(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's chunk of `x` along the sequence `dim` under SP; all of `x` otherwise."""
        if not self.sequence_parallel:
            return x
        return x.chunk(self.size, dim=dim)[self.rank]

    @property
    def residual_rng(self) -> TensorParallelRNG | None:
        """The RNG for dropout on the residual stream: per rank under SP (split), else None
        (replicated: the default generator, the same on every rank)."""
        return self.rng if self.sequence_parallel else None


def build_tensor_parallel(
    mesh: ParallelMesh,
    cfg: ModelConfig,
    sequence_parallel: bool,
    seed: int,
    device: torch.device | str,
) -> TensorParallel | None:
    """The shared TP state for this rank, or None at tensor = 1. Collective (creates groups)."""
    size = mesh.size("tensor")
    if size == 1:
        return None
    check_tensor_parallel(cfg, size, sequence_parallel)
    rank = mesh.coordinate("tensor")
    replicas = size // cfg.kv_heads if cfg.kv_heads < size else 1
    replica_groups = {replicas: mesh.subgroup("tensor", replicas)} if replicas > 1 else {}
    return TensorParallel(mesh.group("tensor"), size, rank, sequence_parallel,
                          TensorParallelRNG(seed, rank, device), replica_groups)


def check_tensor_parallel(cfg: ModelConfig, size: int, sequence_parallel: bool) -> None:
    """Raise a one-line ConfigError unless `cfg` splits over `size` tensor-parallel ranks."""
    if size == 1:
        return
    attention = cfg.has_kind("attention")  # a Mamba-only model has no attention heads
    if attention and cfg.num_attention_heads % size:
        raise ConfigError(
            f"model.num_attention_heads = {cfg.num_attention_heads} is not divisible by "
            f"parallel.tensor = {size}; use a tensor degree that divides the heads"
        )
    if attention and cfg.kv_heads % size and size % cfg.kv_heads:
        raise ConfigError(
            f"model.num_query_groups = {cfg.kv_heads} and parallel.tensor = {size}: one must "
            "divide the other (the key/value heads are split or replicated across the ranks)"
        )
    if cfg.ffn_size % size:
        raise ConfigError(
            f"model.ffn_hidden_size = {cfg.ffn_size} is not divisible by parallel.tensor = {size}"
        )
    if sequence_parallel and cfg.seq_length % size:
        raise ConfigError(
            f"model.seq_length = {cfg.seq_length} is not divisible by parallel.tensor = {size}, "
            "which parallel.sequence_parallel needs"
        )


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T + b_r: this rank's rows (output features) of a linear layer.

    `parts` lays out the full output features (see sharding.py): [(out_features, 1)] for a plain
    layer, one (units, unit_size) per fused part otherwise. The input is replicated (or gathered
    from sequence shards); the output stays split by features.
    """

    def __init__(
        self, in_features: int, parts: list[tuple[int, int]], bias: bool, tp: TensorParallel
    ) -> None:
        super().__init__()
        self.tp = tp
        self.sharding = Sharding(0, tuple(parts), tp.rank, tp.size)
        out_local = self.sharding.local_rows
        self.weight = nn.Parameter(torch.empty(out_local, in_features))
        self.bias = nn.Parameter(torch.empty(out_local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.tp.to_full_sequence(x), self.weight, self.bias)

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": self.sharding, "bias": self.sharding} if self.bias is not None else {
            "weight": self.sharding}

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.shape[1]}, out_features={self.weight.shape[0]} of "
                f"{self.sharding.full_rows}, bias={self.bias is not None}")


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T + b: this rank's columns (input features) of a linear layer.

    The input is split by features (a column-parallel layer's output); the partial products are
    summed over the ranks (or reduce-scattered to sequence shards), then the replicated bias added.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp
        self.sharding = even_sharding(1, in_features, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp.size))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.reduce_partial_sums(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y

    def param_shardings(self) -> dict[str, Sharding]:
        return {"weight": self.sharding}

    def extra_repr(self) -> str:
        return (f"in_features={self.weight.shape[1]} of {self.sharding.full_rows}, "
                f"out_features={self.weight.shape[0]}, bias={self.bias is not None}")


def column_linear(
    in_features: int, parts: list[tuple[int, int]], bias: bool, tp: TensorParallel | None
) -> nn.Module:
    """nn.Linear at T = 1, else ColumnParallelLinear; `parts` as in ColumnParallelLinear."""
    if tp is None:
        return nn.Linear(in_features, sum(u * n for u, n in parts), bias=bias)
    return ColumnParallelLinear(in_features, parts, bias, tp)


def row_linear(
    in_features: int, out_features: int, bias: bool, tp: TensorParallel | None
) -> nn.Module:
    """nn.Linear at T = 1, else RowParallelLinear."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)
