"""The parallel grid: where each process (rank) sits among the five kinds of parallelism.

The ranks of a run form a 4-D grid, outermost axis first:

    grid = torch.arange(world_size).view(pipeline, data, context, tensor)

so rank `grid[p, d, c, t]` is ((p * data + d) * context + c) * tensor + t, and the ranks along one
axis (all other coordinates fixed) form that axis's process group. Tensor parallelism is innermost:
a tensor-parallel group is a run of consecutive ranks, which keeps its heavy traffic inside one
node's NVLink domain when `tensor` <= GPUs per node. For example 8 ranks with pipeline = 2 and
tensor = 2 (so data = 8 / (2 * 2) = 2):

    grid = [[[[0, 1]], [[2, 3]]],        tensor groups    {0,1} {2,3} {4,5} {6,7}
            [[[4, 5]], [[6, 7]]]]        data groups      {0,2} {1,3} {4,6} {5,7}
                                         pipeline groups  {0,4} {1,5} {2,6} {3,7}

Expert parallelism is not a fifth axis: it reuses the data x context ranks of a pipeline stage, so
`expert` must divide data * context. Three flattened groups serve context and expert parallelism
(`flat_rank_lists`): for each (pipeline, tensor) coordinate, the data x context ranks in grid order
form the "data_context" group (gradients and the loss are averaged over it); cut into runs of
`expert` consecutive ranks they form the "expert" groups (the ranks that split the experts among
them), and the ranks at the same place of every run form the "expert_data" groups (the replicas of
one expert shard). With 8 ranks, data = 4, context = 2, expert = 4 (pipeline = tensor = 1):

    data_context {0..7}   expert {0,1,2,3} {4,5,6,7}   expert_data {0,4} {1,5} {2,6} {3,7}

`ParallelDims` is the validated degrees (plain numbers, no processes needed); `ParallelMesh` adds
this rank's coordinates and the process groups (from a torch `DeviceMesh`). Both are passed
explicitly to whatever needs them; nothing here is module-level state. With one process there is
no process group at all: every degree is 1 and costs nothing.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from trireme.config import ParallelConfig
from trireme.errors import ConfigError
from trireme.words import count_of

AXES = ("pipeline", "data", "context", "tensor")  # outermost to innermost
FLAT = ("data_context", "expert", "expert_data")  # groups across axes (module docstring)


@dataclass(frozen=True)
class ParallelDims:
    """Degrees of data, pipeline, context, tensor and expert parallelism (each >= 1)."""

    data: int = 1
    pipeline: int = 1
    context: int = 1
    tensor: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for axis in (*AXES, "expert"):
            if getattr(self, axis) < 1:
                raise ConfigError(f"parallel degree {axis} = {getattr(self, axis)} must be >= 1")
        if (self.data * self.context) % self.expert:
            raise ConfigError(
                f"parallel.expert = {self.expert} must divide data x context = "
                f"{self.data} x {self.context} (experts reuse those ranks)"
            )

    @property
    def world_size(self) -> int:
        return math.prod(self.degree(axis) for axis in AXES)

    @property
    def shape(self) -> tuple[int, ...]:
        """The grid's shape, (pipeline, data, context, tensor)."""
        return tuple(self.degree(axis) for axis in AXES)

    def degree(self, axis: str) -> int:
        return getattr(self, axis)

    def check_world_size(self, world_size: int) -> None:
        """Raise a one-line ConfigError unless the degrees multiply to `world_size`."""
        if self.world_size != world_size:
            product = " x ".join(str(self.degree(a)) for a in AXES)
            raise ConfigError(
                f"data x pipeline x context x tensor = {product} = {self.world_size} "
                f"(in grid order pipeline, data, context, tensor), but the world size is "
                f"{world_size}"
            )

    def coordinates(self, rank: int) -> dict[str, int]:
        """This rank's position on each axis, e.g. {"pipeline": 0, ..., "tensor": 1}."""
        coords = {}
        for axis in reversed(AXES):  # innermost varies fastest
            rank, coords[axis] = divmod(rank, self.degree(axis))
        return {axis: coords[axis] for axis in AXES}

    @classmethod
    def from_config(cls, cfg: ParallelConfig, world_size: int) -> ParallelDims:
        """The degrees for `world_size` processes: data = world / (pipeline * context * tensor)."""
        model_parallel = cfg.pipeline * cfg.context * cfg.tensor
        if model_parallel < 1 or world_size % model_parallel:
            launch = f"torchrun --nproc_per_node {model_parallel} -m trireme train ..."
            raise ConfigError(
                f"parallel.pipeline x parallel.context x parallel.tensor = {cfg.pipeline} x "
                f"{cfg.context} x {cfg.tensor} = {model_parallel} does not divide the world size "
                f"{world_size} (processes launched); launch a multiple of {model_parallel} "
                f"processes, e.g. {launch}"
            )
        dims = cls(
            data=world_size // model_parallel,
            pipeline=cfg.pipeline,
            context=cfg.context,
            tensor=cfg.tensor,
            expert=cfg.expert,
        )
        dims.check_world_size(world_size)
        return dims


def flat_rank_lists(dims: ParallelDims, name: str) -> list[list[int]]:
    """Every group of the flattened kind `name` (one of FLAT), as lists of global ranks."""
    grid = torch.arange(dims.world_size, device="cpu").view(dims.shape)  # [p, d, c, t]
    rows = grid.permute(0, 3, 1, 2).reshape(-1, dims.data * dims.context)  # one per (p, t)
    if name == "data_context":
        return rows.tolist()
    runs = rows.reshape(rows.shape[0], -1, dims.expert)  # [(p, t), replicas, expert]
    if name == "expert":
        return runs.reshape(-1, dims.expert).tolist()
    if name == "expert_data":
        return runs.transpose(1, 2).reshape(-1, runs.shape[1]).tolist()
    raise ValueError(f"{name!r} is not one of {FLAT}")


def flat_size(dims: ParallelDims, name: str) -> int:
    sizes = {"data_context": dims.data * dims.context, "expert": dims.expert,
             "expert_data": dims.data * dims.context // dims.expert}
    return sizes[name]


@dataclass
class ParallelMesh:
    """This process's place in the grid: degrees, coordinates and one process group per axis.

    Build it with `ParallelMesh.build(dims, device_type)` on every rank. `device_mesh` is None in a
    single process (no process group exists then and `group()` returns None).
    """

    dims: ParallelDims
    rank: int = 0
    device_mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh
    _subgroups: dict[tuple[str, int], dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _flat_meshes: dict[str, object] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, dims: ParallelDims, device_type: str = "cpu") -> ParallelMesh:
        """Create the DeviceMesh (and its process groups) for `dims`; collective over all ranks.

        The default process group must already exist when `dims.world_size` > 1 (see
        `init_distributed`).
        """
        if dims.world_size == 1:
            return cls(dims)
        if not dist.is_initialized():
            raise RuntimeError("ParallelMesh.build needs torch.distributed to be initialized")
        dims.check_world_size(dist.get_world_size())

        mesh = init_device_mesh(device_type, dims.shape, mesh_dim_names=AXES)
        built = cls(dims, dist.get_rank(), mesh)
        built._build_flat_groups()
        return built

    def _build_flat_groups(self) -> None:
        """The flattened groups that have more than one rank and are not an axis group already
        (data_context at context = 1 is the data group). Collective: every rank creates every
        group, in the same order."""
        for name in FLAT:
            size = flat_size(self.dims, name)
            if size == 1 or (name == "data_context" and self.dims.context == 1):
                continue
            if name == "expert_data" and self.dims.expert == 1:
                continue  # the data_context group
            for ranks in flat_rank_lists(self.dims, name):
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._subgroups[(name, 0)] = group

    def data_context_mesh(self):
        """The 1-D DeviceMesh over this rank's data x context ranks (the data axis when context
        is 1): what FSDP shards over, since those ranks hold the same weights."""
        if self.dims.context == 1:
            return self.device_mesh["data"]
        if "data_context" not in self._flat_meshes:
            sub = self.device_mesh["data", "context"]
            self._flat_meshes["data_context"] = sub._flatten("data_context")
        return self._flat_meshes["data_context"]

    def size(self, axis: str) -> int:
        """Ranks in this rank's group along `axis` (one of AXES or FLAT)."""
        return flat_size(self.dims, axis) if axis in FLAT else self.dims.degree(axis)

    def coordinate(self, axis: str) -> int:
        """This rank's index along `axis` (its rank inside that axis's group)."""
        if axis in FLAT:
            ranks = next(r for r in flat_rank_lists(self.dims, axis) if self.rank in r)
            return ranks.index(self.rank)
        return self.dims.coordinates(self.rank)[axis]

    @property
    def is_main(self) -> bool:
        """Global rank 0: the one process that writes files and prints."""
        return self.rank == 0

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank along `axis`, one of AXES or FLAT (None in a single
        process, and for a flattened group of one rank)."""
        if self.device_mesh is None:
            return None
        if axis == "data_context" and self.dims.context == 1:
            return self.device_mesh.get_group("data")
        if axis == "expert_data" and self.dims.expert == 1:
            return self.group("data_context")
        if axis in FLAT:
            return self._subgroups.get((axis, 0))
        return self.device_mesh.get_group(axis)

    def subgroup(self, axis: str, size: int) -> dist.ProcessGroup | None:
        """The group of `size` consecutive ranks along `axis` that holds this rank.

        E.g. with tensor = 4, subgroup("tensor", 2) is {t0, t1} or {t2, t3}: the ranks that hold
        the same replicated key/value head when there are 2 query groups. Collective the first
        time (every rank creates every subgroup, in the same order); cached afterwards.
        """
        degree = self.size(axis)
        if degree % size:
            raise ValueError(f"a {axis} subgroup of {size} ranks does not divide {degree}")
        if self.device_mesh is None or size == 1:
            return None
        key = (axis, size)
        if key not in self._subgroups:
            grid = torch.arange(self.dims.world_size, device="cpu").view(self.dims.shape)
            along = grid.movedim(AXES.index(axis), -1).reshape(-1, degree // size, size)
            for ranks in along.reshape(-1, size).tolist():  # every rank walks every subgroup
                group = dist.new_group(ranks)
                if self.rank in ranks:
                    self._subgroups[key] = group
        return self._subgroups[key]


@dataclass(frozen=True)
class DistributedEnv:
    """The launch as torchrun describes it. `created` is True when `init_distributed` started the
    default process group (and so should destroy it at the end)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    created: bool = False
    store: dist.Store | None = None  # the rendezvous store (the watchdog's heartbeats)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        """Destroy the default process group if this environment created it."""
        if self.created and dist.is_initialized():
            dist.destroy_process_group()


def launched_rank() -> int:
    """This process's global rank: the process group's, else torchrun's RANK, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def launched_world_size() -> int:
    """Processes in the run: the process group's size, else torchrun's WORLD_SIZE, else 1."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(device_type: str = "cpu", timeout_minutes: float = 10.0) -> DistributedEnv:
    """Start torch.distributed from torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK).

    One process (no WORLD_SIZE, or 1): nothing is started. On CUDA each process takes GPU
    LOCAL_RANK and the NCCL backend; on the CPU gloo. A collective waits `timeout_minutes` for a
    rank that does not answer (gloo then raises; NCCL gets a little longer, so that the watchdog
    names the rank first). An already initialized process group (a test that started its own) is
    used as it is.
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dist.is_available() and dist.is_initialized():
        return DistributedEnv(dist.get_rank(), dist.get_world_size(), local_rank)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return DistributedEnv()
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE = {world_size} but {', '.join(missing)} not set: launch with torchrun "
            "(torchrun --nproc_per_node N -m trireme train ..., see docs/parallelism.md)"
        )
    if device_type == "cuda" and not dist.is_nccl_available():
        raise ConfigError(
            "this torch build has no NCCL, which multi-GPU training needs; install a CUDA build "
            "of torch, or set train.device=cpu to use gloo"
        )
    timeout = timedelta(minutes=timeout_minutes)
    # our own rendezvous, so that the watchdog can keep the store
    store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
    # torchrun --max-restarts keeps its store across restarts: without a fresh prefix a restarted
    # rank reads the dead attempt's gloo addresses and the restart fails to connect
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"trireme/attempt-{attempt}", store)
    if device_type == "cuda":
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1))
        if max(per_node - 1, local_rank) >= torch.cuda.device_count():  # alike on every rank
            raise ConfigError(
                f"{count_of(per_node, 'process', 'processes')} on a node with "
                f"{count_of(torch.cuda.device_count(), 'GPU')} visible; "
                "launch at most that many processes per node (torchrun --nproc_per_node) or set "
                "train.device=cpu"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size,
                                timeout=timeout * 1.2 + timedelta(seconds=30), device_id=device)
    else:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout)
    return DistributedEnv(rank, world_size, local_rank, created=True, store=store)


def pick_device(name: str) -> torch.device:
    """train.device / --device: auto (a GPU where there is one), cuda or cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but no CUDA GPU is available; use auto or cpu")
    return torch.device(name)
