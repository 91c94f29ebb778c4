"""The run's layout, resolved once: "is this layout valid, and what is the micro batch?"

`resolve_layout(cfg, world_size)` is a pure function (nothing is started, read or changed) from a
config and the number of processes to a frozen `Layout`: the five parallel degrees, the micro
batch, the micro batches of a step on each data-parallel replica, the pipeline stages and the
group sizes that follow from them. The trainer (trireme.training.build), the planner
(trireme.plan) and `trireme train`'s checks all ask it, so they accept and refuse the same
layouts. It runs before any process group exists, so a bad layout stops every rank with the
same one-line ConfigError.

Each rule is one small pure function, called from `resolve_layout` in a fixed order (the first
broken rule is the error). The rules about a model's own parts stay beside them and are called
from here: the tensor split (trireme.parallel.tensor), the vision encoder (trireme.models.vision),
the pipeline stage split (trireme.models.stages) and the degree rules of the config's own
checks (trireme.config.checks.check_degrees). So this module sits above trireme.models in the
floors (tests/test_architecture.py).

`train.micro_batch_size`: a set value is kept; 0 is derived from the launch (global batch / (DP x
PP) when that divides, else global / DP: one micro batch per replica); -1 (auto) is fitted to a
GPU by the planner before the layout is resolved (trireme.plan.fit, called by the trainer), and
otherwise takes the largest of 4, 2, 1 that divides the batch of a replica.
"""

from __future__ import annotations

from dataclasses import dataclass

from trireme.config import AUTO_MICRO_BATCH, Config, TrainConfig
from trireme.config.checks import check_degrees
from trireme.errors import ConfigError
from trireme.models.stages import StageSpec, check_pipeline
from trireme.models.vision import check_vision_layout
from trireme.parallel.context_parallel import MODES as CONTEXT_MODES
from trireme.parallel.mesh import ParallelDims
from trireme.parallel.tensor import check_tensor_parallel
from trireme.words import count_of

AUTO_SIZES = (4, 2, 1)  # the micro batches -1 (auto) chooses from without a GPU to fit


@dataclass(frozen=True)
class Layout:
    """The resolved layout of a run (module docstring). `stages`: every pipeline stage in model
    order (one, the whole model, without pipelining); pipeline rank p holds stages p, p + P, ..."""

    world_size: int
    data: int
    pipeline: int
    virtual_pipeline: int
    context: int
    tensor: int
    expert: int
    micro_batch_size: int
    num_micro_batches: int  # per step on each data-parallel replica
    stages: tuple[StageSpec, ...]

    @property
    def dims(self) -> ParallelDims:
        """The degrees as the process grid takes them (trireme.parallel.mesh)."""
        return ParallelDims(data=self.data, pipeline=self.pipeline, context=self.context,
                            tensor=self.tensor, expert=self.expert)

    @property
    def data_context(self) -> int:
        """The ranks that average gradients together (data x context)."""
        return self.data * self.context

    @property
    def expert_data(self) -> int:
        """The replicas of one expert shard (data x context / expert)."""
        return max(self.data_context // self.expert, 1)

    @property
    def samples_per_replica(self) -> int:
        """The samples of a step each data-parallel replica reads."""
        return self.micro_batch_size * self.num_micro_batches

    def rank_stages(self, pipeline_rank: int) -> list[StageSpec]:
        """The stages (model chunks) pipeline rank `pipeline_rank` holds, chunk 0 first."""
        return list(self.stages[pipeline_rank :: self.pipeline])


def resolve_layout(cfg: Config, world_size: int) -> Layout:
    """The layout of `cfg` on `world_size` processes, or the one-line ConfigError of the first
    rule it breaks. Pure: the same inputs give the same record, and `cfg` is only read."""
    p, t = cfg.parallel, cfg.train
    check_degrees(cfg)
    if cfg.model.vision_layers:
        check_vision_layout(cfg.model, p.tensor, p.context, p.sequence_parallel)
    if p.context > 1:
        check_context_parallel(cfg)
    check_expert_parallel(cfg)
    check_data_parallel_mode(cfg)
    if p.data_parallel_mode == "fsdp":
        check_fsdp(cfg)
    check_tensor_parallel(cfg.model, p.tensor, p.sequence_parallel)
    dims = ParallelDims.from_config(p, world_size)
    micro = micro_batch_size(t, dims)
    check_batch_split(t, micro, dims.data, world_size)
    num_micro = t.global_batch_size // (micro * dims.data)
    stages = check_pipeline(cfg.model, p, num_micro)
    return Layout(world_size, dims.data, dims.pipeline, p.virtual_pipeline, dims.context,
                  dims.tensor, dims.expert, micro, num_micro, tuple(stages))


def check_context_parallel(cfg: Config) -> None:
    """What context parallelism needs, and what it does not support yet (one-line errors)."""
    m, p = cfg.model, cfg.parallel
    if p.context_mode not in CONTEXT_MODES:
        raise ConfigError(f"parallel.context_mode = {p.context_mode!r}: use one of "
                          f"{', '.join(CONTEXT_MODES)}")
    heads, kv = m.num_attention_heads // p.tensor, max(m.kv_heads // p.tensor, 1)
    if p.context_mode == "a2a" and (heads % p.context or kv % p.context):
        raise ConfigError(
            f"parallel.context_mode = 'a2a' needs parallel.context = {p.context} to divide the "
            f"{heads} query and {kv} key/value heads of a tensor-parallel rank; use 'allgather'")
    if m.seq_length % (2 * p.context * p.tensor):
        raise ConfigError(
            f"model.seq_length = {m.seq_length} must be divisible by 2 x parallel.context x "
            f"parallel.tensor = {2 * p.context * p.tensor} (each rank holds two equal chunks)")
    if packed_documents(cfg) and p.context_mode != "allgather":
        raise ConfigError(f"{packed_documents(cfg)} (packed documents) with parallel.context > 1 "
                          "needs parallel.context_mode = 'allgather'")
    unsupported = {"model.dropout > 0": m.dropout > 0,
                   "mixture-of-experts layers (E)": m.has_kind("moe"),
                   "Mamba-2 layers (M)": m.has_kind("mamba")}
    for name, used in unsupported.items():
        if used:
            raise ConfigError(f"parallel.context > 1 with {name}: not implemented yet")


def packed_documents(cfg: Config) -> str:
    """The key that puts several documents in a sample with per-document attention ("": none)."""
    return ("data.reset_attention_mask" if cfg.data.reset_attention_mask else
            "data.pack_conversations" if cfg.data.pack_conversations else "")


def check_expert_parallel(cfg: Config) -> None:
    """Expert parallelism needs experts to split."""
    if cfg.parallel.expert > 1 and not cfg.model.has_kind("moe"):
        raise ConfigError(f"parallel.expert = {cfg.parallel.expert} needs mixture-of-experts "
                          "layers (E in model.layer_pattern)")


def check_data_parallel_mode(cfg: Config) -> None:
    mode = cfg.parallel.data_parallel_mode
    if mode not in ("ddp", "fsdp"):
        raise ConfigError(f"parallel.data_parallel_mode = {mode!r}: use 'ddp' or 'fsdp'")


def check_fsdp(cfg: Config) -> None:
    """What FSDP mode (trireme.step.fsdp) does not support yet, said before anything starts."""
    p = cfg.parallel
    if cfg.model.precision != "fp32":
        raise ConfigError(f"parallel.data_parallel_mode = 'fsdp' with model.precision = "
                          f"{cfg.model.precision}: not implemented yet; use fp32 or 'ddp'")
    if p.tensor > 1:
        raise ConfigError("parallel.data_parallel_mode = 'fsdp' with parallel.tensor > 1: not "
                          "implemented yet; use 'ddp'")
    if p.expert > 1:
        raise ConfigError("parallel.data_parallel_mode = 'fsdp' with parallel.expert > 1: not "
                          "implemented yet; use 'ddp' (with parallel.distributed_optimizer)")
    if p.distributed_optimizer:
        raise ConfigError("parallel.distributed_optimizer is for 'ddp'; 'fsdp' already shards "
                          "the optimizer state")
    if cfg.checkpoint.dir and cfg.checkpoint.format != "sharded":
        raise ConfigError("checkpoints with parallel.data_parallel_mode = 'fsdp' need "
                          "checkpoint.format = 'sharded' (checkpoint.dir set)")


def micro_batch_size(t: TrainConfig, dims: ParallelDims) -> int:
    """train.micro_batch_size as the layout takes it (module docstring): a set value, or the one
    derived (0) or chosen without a GPU to fit (-1, auto)."""
    if t.micro_batch_size > 0:
        return t.micro_batch_size
    if t.global_batch_size % dims.data:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} does not split over the "
            f"data-parallel degree {dims.data}; change the batch size or the number of processes")
    per_replica = t.global_batch_size // dims.data
    if t.micro_batch_size == AUTO_MICRO_BATCH:
        return max(d for d in AUTO_SIZES if per_replica % d == 0)
    stages = dims.pipeline if per_replica % dims.pipeline == 0 else 1
    return per_replica // stages


def check_batch_split(t: TrainConfig, micro: int, data: int, world_size: int) -> None:
    """The global batch is whole micro batches on every data-parallel replica."""
    if t.global_batch_size % (micro * data):
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size x data-parallel degree = {micro} x {data} "
            f"(data parallelism = {count_of(world_size, 'process', 'processes')} / (pipeline x "
            "context x tensor)); change the batch sizes or the number of processes"
        )
