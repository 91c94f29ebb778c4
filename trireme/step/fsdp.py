"""FSDP mode (`parallel.data_parallel_mode = "fsdp"`): torch's `fully_shard` (FSDP2) over DP.

Each transformer block, and then the whole model (embedding, final norm, output), becomes one
FSDP unit: its parameters are stored as 1/DP shards (DTensors on the data-parallel axis of the
mesh; under context parallelism on the flattened data x context axis, 1/(DP x CP) shards),
all-gathered just before the unit's forward and backward, and its gradients are reduce-scattered
(averaged) right after its backward, so they overlap the rest of the backward by construction.
Only the last micro batch of a step reduces: the earlier ones run with gradient sync off and
accumulate unsharded gradients.

The optimizer is the fp32 AdamW of `trireme.optim.optimizer` over the sharded parameters; the
gradient norm sums the squares of each rank's shards over the DP group (and the pipeline stages).

Under pipeline parallelism each model chunk (stage) is sharded the same way and is its own FSDP
root; its reduction runs in its own last backward of the step. A tied embedding's two copies are
sharded alike on the first and last stage, so their gradient shards are summed shard to shard.

Limits of this first version (each a one-line ConfigError in
`trireme.parallel.layout.check_fsdp`): fp32 only (bf16 wants
fully_shard's MixedPrecisionPolicy and fp32 sharded parameters), no tensor or expert
parallelism, and checkpoints in the sharded format only. The model is built and initialized
whole on each rank before it is sharded, so it must fit on one device at the start.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from trireme.config import Config
from trireme.optim.optimizer import MixedPrecisionOptimizer, named_trainable_parameters
from trireme.parallel.mesh import ParallelMesh


def shard_model(model: nn.Module, mesh: ParallelMesh) -> None:
    """Apply fully_shard to each block, then to the model (in place), over the data x context
    ranks (under context parallelism they hold the same weights, and their gradients are
    averaged together: each context rank's loss is scaled to the whole sequence's)."""
    dp_mesh = mesh.data_context_mesh()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)


@contextmanager
def gathered(model: nn.Module) -> Iterator[None]:
    """Every FSDP unit of `model` all-gathered inside, resharded after: for calls that skip the
    units' forward hooks (decoding runs each block's `forward` directly, eager even when the
    blocks are compiled). Collective over the data-parallel ranks; nothing without FSDP."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def _local(t: Tensor) -> Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def local_grad(param: nn.Parameter) -> Tensor:
    """This rank's shard of an FSDP parameter's (DP-averaged) gradient."""
    return _local(param.grad)


class FSDPOptimizer(MixedPrecisionOptimizer):
    """fp32 AdamW over FSDP-sharded parameters: norm and clipping act on the local shards.

    Under pipeline parallelism `model` is this rank's chunks; the squares of the norm are also
    summed over `pipeline_group`, leaving out the names in `skip` (the last stage's copy of a
    tied embedding, which the first stage counts)."""

    def __init__(self, model: nn.Module | list[nn.Module], cfg: Config, device: torch.device,
                 group: dist.ProcessGroup, pipeline_group: dist.ProcessGroup | None = None,
                 skip: frozenset[str] = frozenset()) -> None:
        self.dp_group = group
        self.pipeline_group = pipeline_group
        self.skip = skip
        super().__init__(named_trainable_parameters(model), cfg.optimizer, "fp32", device)

    def _grads(self) -> list[Tensor]:
        # views of the local shards: scaling them in place scales the DTensor gradients
        return [_local(p.grad) for p in self.params if p.grad is not None]

    def _global_grad_norm(self, grads: list[Tensor]) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for name, p in zip(self.names, self.params):
            if p.grad is not None and name not in self.skip:
                total += _local(p.grad).float().square().sum()
        dist.all_reduce(total, group=self.dp_group)
        if self.pipeline_group is not None:
            dist.all_reduce(total, group=self.pipeline_group)
        return total.sqrt()


class GradientSyncSwitch:
    """The step runners' reducer interface for FSDP: gradients are reduced (by FSDP's own hooks)
    only in the last backward of each model chunk (each chunk is its own FSDP root)."""

    def __init__(self, model: nn.Module | list[nn.Module]) -> None:
        self.chunks = [model] if isinstance(model, nn.Module) else list(model)
        self._last = False

    def start_step(self) -> None:
        self.last_micro_batch = False

    @property
    def last_micro_batch(self) -> bool:
        return self._last

    @last_micro_batch.setter
    def last_micro_batch(self, value: bool) -> None:
        self._last = value
        for chunk in self.chunks:
            chunk.set_requires_gradient_sync(value)

    def set_last_backward(self, chunk: int, last: bool) -> None:
        """Whether the next backward of `chunk` is its last one this step (FSDP reduces then)."""
        self.chunks[chunk].set_requires_gradient_sync(last)

    def finish(self) -> None:
        pass  # FSDP waits for its reduce-scatters at the end of the backward
