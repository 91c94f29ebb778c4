"""What a training checkpoint saves and loads, as the run hands it over: `TrainingState`.

Its parts follow the small protocol torchtitan's checkpointing uses, `Stateful`: `state_dict()`
gives their state, `load_state_dict(state)` puts it back. The model chunks are torch modules and
the optimizer (trireme.optim.optimizer) has the same two methods; the run's progress (step,
consumed samples) is any object with them (trireme.training.build.TrainState). The checkpoint
code reads and loads through these and the layout beside them (mesh, device, world size); it
never sees the trainer itself (trireme.training, a floor above).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from trireme.config import Config
from trireme.optim.optimizer import MixedPrecisionOptimizer
from trireme.parallel.mesh import ParallelMesh
from trireme.parallel.tensor import TensorParallel


class Stateful(Protocol):
    """An object whose state a checkpoint saves and restores."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class TrainingState:
    """The parts of a run a checkpoint saves and loads (in place), and where the run is laid
    out. `progress`: {"step", "consumed_samples"}; `pipelined`: the chunks are pipeline stages
    run by a schedule (parallel.pipeline > 1)."""

    cfg: Config
    chunks: list[nn.Module]  # this rank's model chunks (pipeline stages; [model] without)
    optimizer: MixedPrecisionOptimizer
    progress: Stateful
    mesh: ParallelMesh
    device: torch.device
    world_size: int
    pipelined: bool = False

    @property
    def is_main(self) -> bool:
        """Global rank 0: the rank that writes the gathered format and prints."""
        return self.mesh.is_main

    @property
    def data_parallel(self) -> int:
        return self.mesh.size("data")

    @property
    def step(self) -> int:
        return int(self.progress.state_dict()["step"])

    @property
    def tensor_parallel(self) -> TensorParallel | None:
        """What the tensor-parallel layers share (its RNG is saved), None at tensor = 1."""
        return self.chunks[0].tp

    @property
    def pipeline_group(self):
        """The pipeline group the stages are gathered over (None without pipelining)."""
        return self.mesh.group("pipeline") if self.pipelined else None
