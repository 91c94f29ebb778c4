"""What a layer needs to know of the parallel layout: one `ParallelContext` per run.

A layer never reads process groups from a global: it is given this object at construction and asks
it for its groups and random streams. It holds the mesh (every axis group and the flattened
data x context, expert and expert-data groups, trireme.parallel.mesh) and the tensor-parallel state
that the column / row / vocabulary-parallel layers share (trireme.parallel.tensor).
`ParallelContext()` is the single-process context: every degree 1, no group, no forked stream, and
the layers built from it are the plain torch ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trireme.config import ModelConfig
from trireme.parallel.context_parallel import ContextParallel
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.parallel.random import TensorParallelRNG
from trireme.parallel.tensor import TensorParallel, build_tensor_parallel


@dataclass
class ParallelContext:
    """The groups and random streams of this rank (module docstring)."""

    mesh: ParallelMesh = field(default_factory=lambda: ParallelMesh(ParallelDims()))
    tensor: TensorParallel | None = None  # None at tensor = 1
    context: ContextParallel | None = None  # None at context = 1

    def size(self, axis: str) -> int:
        """Ranks along `axis`: "pipeline", "data", "context", "tensor", "data_context", "expert"
        or "expert_data"."""
        return self.mesh.size(axis)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """This rank's process group along `axis` (None where there is only one rank)."""
        return self.mesh.group(axis)

    @property
    def head_rng(self) -> TensorParallelRNG | None:
        """The stream for dropout on a tensor split across the TP ranks (heads, features)."""
        return self.tensor.rng if self.tensor is not None else None

    @property
    def residual_rng(self) -> TensorParallelRNG | None:
        """The stream for dropout on the residual stream: per TP rank under sequence parallelism,
        else None (the default generator, the same on every rank)."""
        return self.tensor.residual_rng if self.tensor is not None else None


def build_parallel_context(
    mesh: ParallelMesh, cfg: ModelConfig, sequence_parallel: bool, seed: int,
    device: torch.device | str, context_mode: str = "allgather",
) -> ParallelContext:
    """This rank's context. Collective under tensor parallelism (creates the K/V replica groups)."""
    context = None
    if mesh.size("context") > 1:
        context = ContextParallel(mesh.group("context"), mesh.size("context"),
                                  mesh.coordinate("context"), context_mode)
    tensor = build_tensor_parallel(mesh, cfg, sequence_parallel, seed, device)
    return ParallelContext(mesh, tensor, context)
