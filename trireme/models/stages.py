"""Pipeline parallelism, part 1: which layers each stage holds.

The model's layers (a mixer and the sublayers after it, trireme.models.block) are cut into
`pipeline * virtual_pipeline` contiguous stages, in model order: evenly when every layer costs the
same (the standard transformer), else balanced by their cost (`layer_costs`: the forward FLOPs per
token each sublayer class declares), or as parallel.pipeline_layers says.
Pipeline rank p holds the stages p, p + P, p + 2P, ... (its "model chunks", one per virtual
stage, Megatron's interleaved assignment), so with P = 2 and 2 virtual stages:

    stage:   0        1        2        3
    rank:    0        1        0        1          (stage s lives on rank s % P, chunk s // P)

The first stage also holds the embedding (and learned positions), the last the final norm, the
output layer and the loss. Each chunk is a `GPT` built with a `StageSpec`: the same module names
as the whole model (`layers.17.mlp.fc1.weight`, never a stage-local index), so initialization by
(seed, name), checkpoints and gathered gradients all speak the single-process names.

With tied embeddings the last stage keeps its own copy of `embedding.weight` for the output layer;
both copies start identical (same seed and name), their gradients are summed after the backward
(`TiedEmbeddingSync` in pipeline_step.py) and so they stay identical.
"""

from __future__ import annotations

from dataclasses import dataclass

from trireme.config import ModelConfig, ParallelConfig
from trireme.errors import ConfigError
from trireme.models.block import SUBLAYERS
from trireme.words import count_of


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage of the model: its global layer range and whether it is first / last."""

    start: int  # first transformer layer (global index)
    stop: int  # one past the last
    first: bool
    last: bool

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)


def layer_flops(cfg: ModelConfig, kinds: tuple[str, ...], seq_length: int | None = None
                ) -> float:
    """Forward FLOPs per token of one layer, / 2: each sublayer's `flops` (Megatron's formula,
    trireme.models.sublayer), summed in order."""
    return sum(SUBLAYERS[kind].flops(cfg, seq_length) for kind in kinds)


def layer_costs(cfg: ModelConfig) -> list[float]:
    """The cost of each layer: the FLOPs of its sublayers."""
    return [layer_flops(cfg, kinds) for kinds in cfg.layer_kinds]


def balanced_counts(costs: list[float], stages: int) -> list[int]:
    """Layers per stage (contiguous, at least one each) that minimize the costliest stage."""
    n = len(costs)
    if n < stages:
        raise ConfigError(f"{count_of(n, 'layer')} cannot fill pipeline x virtual_pipeline = "
                          f"{count_of(stages, 'stage')}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest max-stage cost of the first i layers in k stages, and the cut
    best = [[(float("inf"), 0)] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, stages + 1):
        for i in range(k, n - (stages - k) + 1):
            best[k][i] = min((max(best[k - 1][j][0], prefix[i] - prefix[j]), j)
                             for j in range(k - 1, i))
    counts, i = [], n
    for k in range(stages, 0, -1):
        j = best[k][i][1]
        counts.append(i - j)
        i = j
    return counts[::-1]


def stage_layer_counts(
    num_layers: int, stages: int, explicit: list[int] | tuple[int, ...] = (),
    embedding_as_layer: bool = False, costs: list[float] | None = None,
) -> list[int]:
    """Layers per stage (model order): `explicit` checked, an even division, or (when `costs`
    differ between layers) the split that balances them.

    With `embedding_as_layer` the embedding and the output layer take one slot each (of the mean
    layer cost), so num_layers + 2 slots are divided and the first and last stages get one layer
    fewer.
    """
    if explicit:
        if len(explicit) != stages or sum(explicit) != num_layers or min(explicit) < 0:
            raise ConfigError(
                f"parallel.pipeline_layers = {list(explicit)} must have pipeline x "
                f"virtual_pipeline = {stages} entries >= 0 summing to model.num_layers = "
                f"{num_layers}"
            )
        return list(explicit)
    if costs is not None and len(set(costs)) > 1 and stages > 1:
        ends = [sum(costs) / len(costs)] if embedding_as_layer else []
        counts = balanced_counts([*ends, *costs, *ends], stages)
        if embedding_as_layer:
            counts[0], counts[-1] = counts[0] - 1, counts[-1] - 1
        return counts
    slots = num_layers + 2 if embedding_as_layer and stages > 1 else num_layers
    if slots % stages:
        extra = " + 2 (embedding and output)" if slots != num_layers else ""
        raise ConfigError(
            f"model.num_layers = {num_layers}{extra} does not divide into pipeline x "
            f"virtual_pipeline = {stages} equal stages; set parallel.pipeline_layers to the layers "
            "of each stage, e.g. [" + ", ".join(map(str, _uneven(num_layers, stages))) + "]"
        )
    counts = [slots // stages] * stages
    if slots != num_layers:
        counts[0] -= 1
        counts[-1] -= 1
    return counts


def _uneven(num_layers: int, stages: int) -> list[int]:
    """A near-even split for the error message: the extra layers go to the middle stages first
    (the first and last also hold the embedding and the head)."""
    base, extra = divmod(num_layers, stages)
    counts = [base] * stages
    for i in ([*range(1, stages - 1), stages - 1, 0])[:extra]:
        counts[i] += 1
    return counts


def stage_specs(cfg: ModelConfig, pcfg: ParallelConfig) -> list[StageSpec]:
    """Every stage of the model, in model order (stage s on pipeline rank s % pipeline)."""
    stages = pcfg.pipeline * pcfg.virtual_pipeline
    counts = stage_layer_counts(cfg.num_layers, stages, pcfg.pipeline_layers,
                                pcfg.pipeline_embedding_as_layer, layer_costs(cfg))
    specs, start = [], 0
    for s, count in enumerate(counts):
        specs.append(StageSpec(start, start + count, s == 0, s == stages - 1))
        start += count
    return specs


def rank_stages(cfg: ModelConfig, pcfg: ParallelConfig, pipeline_rank: int) -> list[StageSpec]:
    """The stages (model chunks) pipeline rank `pipeline_rank` holds, chunk 0 first."""
    specs = stage_specs(cfg, pcfg)
    return specs[pipeline_rank :: pcfg.pipeline]


def check_pipeline(cfg: ModelConfig, pcfg: ParallelConfig, num_micro_batches: int
                   ) -> list[StageSpec]:
    """One-line errors for a pipeline layout that cannot run; else every stage (stage_specs;
    the whole model as one stage without pipelining)."""
    if pcfg.virtual_pipeline > 1 and pcfg.pipeline == 1:
        raise ConfigError(
            f"parallel.virtual_pipeline = {pcfg.virtual_pipeline} needs parallel.pipeline > 1"
        )
    if pcfg.pipeline_layers and pcfg.pipeline == 1:
        raise ConfigError("parallel.pipeline_layers is set but parallel.pipeline = 1")
    specs = [StageSpec(0, cfg.num_layers, True, True)]
    if pcfg.pipeline > 1:
        specs = stage_specs(cfg, pcfg)  # raises on a split that does not fit
    if pcfg.virtual_pipeline > 1 and num_micro_batches % pcfg.pipeline:
        raise ConfigError(
            f"interleaved pipelining (parallel.virtual_pipeline = {pcfg.virtual_pipeline}) needs "
            f"the micro batches per step of each data-parallel replica (train.global_batch_size / "
            f"(train.micro_batch_size x data-parallel degree) = {num_micro_batches}) to be a "
            f"multiple of parallel.pipeline = {pcfg.pipeline}"
        )
    return specs


def bubble_fraction(pipeline: int, virtual_pipeline: int, num_micro_batches: int) -> float:
    """The estimated idle share of a 1F1B step: (P - 1) / (V * M) of the useful time (Megatron's
    estimate; 0 without pipelining)."""
    if pipeline == 1:
        return 0.0
    return (pipeline - 1) / (virtual_pipeline * num_micro_batches)

