"""Every layout of a config on a cluster, each checked by the trainer's own validation.

A candidate is a `Choice`: the settings that select a layout (the requested degrees, modes,
recompute and micro batch, as command-line overrides); the degrees it resolves to on the cluster
are trireme.parallel.layout's `Layout`, the one record of them.

A layout sets parallel.tensor (with sequence parallelism when > 1, except for a vision model,
which does not support it yet), pipeline,
virtual_pipeline, context (+ context_mode), expert, the data-parallel mode (DDP, DDP with the
distributed optimizer, FSDP), train.recompute and train.micro_batch_size; data parallelism is
what is left of the GPUs. A layout is kept only if `trireme.config.validate` and
`trireme.parallel.layout.resolve_layout` (the checks `trireme train` runs before anything
starts) accept it, so the planner never proposes a layout the trainer refuses.

Pruning (stated, so nothing surprises): tensor parallelism stays inside a node (T divides
--gpus-per-node); context parallelism is tried when the sequence is at least 8192 tokens or the
config already uses it; virtual stages up to 4; micro batches are the divisors of the batch per
replica up to 16, and the config's own micro batch where it divides.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from trireme.config import Config, validate
from trireme.errors import ConfigError
from trireme.parallel.context_parallel import MODES as CONTEXT_MODES
from trireme.parallel.layout import Layout, resolve_layout

RECOMPUTE = ("none", "selective", "full")
DP_MODES = ("ddp", "distopt", "fsdp")


@dataclass(frozen=True)
class Choice:
    """The settings of one candidate layout (module docstring)."""

    tensor: int = 1
    pipeline: int = 1
    virtual_pipeline: int = 1
    context: int = 1
    context_mode: str = "allgather"
    expert: int = 1
    dp_mode: str = "ddp"
    recompute: str = "none"
    micro_batch_size: int = 1
    sequence_parallel: bool = False  # with tensor > 1

    @classmethod
    def of(cls, cfg: Config) -> Choice:
        p = cfg.parallel
        mode = "fsdp" if p.data_parallel_mode == "fsdp" else (
            "distopt" if p.distributed_optimizer else "ddp")
        return cls(p.tensor, p.pipeline, p.virtual_pipeline, p.context, p.context_mode, p.expert,
                   mode, cfg.train.recompute, cfg.train.micro_batch_size,
                   p.sequence_parallel and p.tensor > 1)

    def to_dict(self) -> dict:
        return asdict(self)

    def overrides(self) -> list[str]:
        """The command-line overrides that select this layout."""
        out = [f"--parallel.tensor={self.tensor}", f"--parallel.pipeline={self.pipeline}"]
        if self.tensor > 1:
            out.append(f"--parallel.sequence_parallel={str(self.sequence_parallel).lower()}")
        if self.virtual_pipeline > 1:
            out.append(f"--parallel.virtual_pipeline={self.virtual_pipeline}")
        if self.context > 1:
            out += [f"--parallel.context={self.context}",
                    f"--parallel.context_mode={self.context_mode}"]
        if self.expert > 1:
            out.append(f"--parallel.expert={self.expert}")
        if self.dp_mode == "distopt":
            out.append("--parallel.distributed_optimizer=true")
        if self.dp_mode == "fsdp":
            out.append("--parallel.data_parallel_mode=fsdp")
        out += [f"--train.recompute={self.recompute}",
                f"--train.micro_batch_size={self.micro_batch_size}"]
        return out


def apply_layout(cfg: Config, choice: Choice) -> Config:
    """A copy of `cfg` with `choice`'s settings."""
    p, t = cfg.parallel, cfg.train
    same_stages = (choice.pipeline, choice.virtual_pipeline) == (p.pipeline, p.virtual_pipeline)
    parallel = dataclasses.replace(
        p, tensor=choice.tensor, pipeline=choice.pipeline,
        virtual_pipeline=choice.virtual_pipeline,
        sequence_parallel=choice.tensor > 1 and choice.sequence_parallel,
        context=choice.context, context_mode=choice.context_mode, expert=choice.expert,
        data_parallel_mode="fsdp" if choice.dp_mode == "fsdp" else "ddp",
        distributed_optimizer=choice.dp_mode == "distopt",
        pipeline_layers=list(p.pipeline_layers) if same_stages else [])
    train = dataclasses.replace(
        t, recompute=choice.recompute, micro_batch_size=choice.micro_batch_size,
        recompute_layers=t.recompute_layers if choice.recompute == "full" else 0)
    return dataclasses.replace(cfg, parallel=parallel, train=train)  # the model config shared


def resolve(cfg: Config, world: int) -> tuple[Config, Layout]:
    """What `trireme train` makes of `cfg` on `world` processes: the config with its micro batch
    resolved and its layout; the trainer's one-line ConfigError if it refuses them."""
    validate(cfg, need_vocab=False)
    layout = resolve_layout(cfg, world)
    train = dataclasses.replace(cfg.train, micro_batch_size=layout.micro_batch_size)
    return dataclasses.replace(cfg, train=train), layout


def check_layout(cfg: Config, world: int) -> str | None:
    """None when `trireme train` would accept `cfg` on `world` processes, else its one-line
    error."""
    try:
        resolve(cfg, world)
    except ConfigError as e:
        return str(e)
    return None


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0 and (limit is None or d <= limit)]


def _micro_batches(per_replica: int, given: int) -> list[int]:
    """Divisors of the batch per replica up to 16, and the config's own (gpt2-124m's 32), so
    the ranking never drops the layout the user gave (0: per_replica is not whole)."""
    if not per_replica:
        return [1]
    sizes = _divisors(per_replica, 16)
    if given > 16 and per_replica % given == 0:
        sizes.append(given)
    return sizes


def candidate_layouts(cfg: Config, world: int, per_node: int) -> Iterator[Choice]:
    """Every layout to try (module docstring), before validation."""
    m = cfg.model
    moe = m.has_kind("moe")
    contexts = [1]
    if m.seq_length >= 8192 or cfg.parallel.context > 1:
        contexts = [c for c in (1, 2, 4, 8) if world % c == 0]
    experts = _divisors(m.moe_num_experts) if moe else [1]
    for tensor in [t for t in _divisors(per_node) if world % t == 0]:
        for pipeline in _divisors(world // tensor, m.num_layers):
            for context in contexts:
                rest = world // (tensor * pipeline)
                if rest % context:
                    continue
                data = rest // context
                yield from _inner(cfg, tensor, pipeline, context, data, experts)


def _inner(cfg: Config, tensor: int, pipeline: int, context: int, data: int,
           experts: list[int]) -> Iterator[Choice]:
    virtuals = [1] if pipeline == 1 else [v for v in (1, 2, 4)]
    modes = [cfg.parallel.context_mode] if context == 1 else list(CONTEXT_MODES)
    per_replica = cfg.train.global_batch_size // data if cfg.train.global_batch_size % data == 0 \
        else 0
    micro = _micro_batches(per_replica, cfg.train.micro_batch_size)
    dp_modes = DP_MODES if data * context > 1 else ("ddp",)
    # sequence parallelism always with TP (the same traffic, less memory), where supported
    sequence = tensor > 1 and not cfg.model.vision_layers
    for v in virtuals:
        for mode in modes:
            for ep in [e for e in experts if (data * context) % e == 0]:
                for dp_mode in dp_modes:
                    for rec in RECOMPUTE:
                        for mb in micro:
                            yield Choice(tensor, pipeline, v, context, mode, ep, dp_mode, rec, mb,
                                         sequence)


def valid_layouts(cfg: Config, world: int, per_node: int
                  ) -> Iterator[tuple[Choice, Config, Layout]]:
    """(choice, its resolved config, its layout) for every layout the trainer accepts."""
    for choice in candidate_layouts(cfg, world, per_node):
        try:
            laid, layout = resolve(apply_layout(cfg, choice), world)
        except ConfigError:
            continue
        yield choice, laid, layout
