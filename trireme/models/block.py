"""A layer of the model: a mixer sublayer and the sublayers after it, each a pre-norm residual.

    for each sublayer f of the layer:   x = x + f(norm_f(x))

The standard transformer layer is "*-": x = x + attention(attention_norm(x)), then
x = x + mlp(mlp_norm(x)). model.layer_pattern is parsed into each layer's kinds
(ModelConfig.layer_kinds); `build_sublayer` makes a sublayer of its kind from `SUBLAYERS` (one
factory for every kind); the block names each by its kind ("attention", "mlp"; a second MLP in one
layer is "mlp_1") with its norm before it ("attention_norm"), so the parameter names of the
standard layer are those checkpoints have always had. What a kind costs (FLOPs, parameters,
activations) and its checkpoint names, each class declares (trireme.models.sublayer): the stage
split, MFU, the planner and the converters read them through `SUBLAYERS`.

What a sublayer tells the block (and nobody pokes its attributes from outside):
- `mixes`: whether it mixes positions (takes rope and a decoding state) or not;
- `set_recompute(selective)`: what selective recomputation may rerun inside it;
- `new_cache(batch, max_len, device, dtype)`: the state it keeps between decoding steps (None),
  one row per request slot of the serving engine; one that declares `pages = True`
  (attention) takes `paged=PagedLayout(...)` instead and returns its share of the engine's
  block pool (trireme.models.paged);
- `init_rules()`: the role of each of its weights (trireme.models.init).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trireme.config import ModelConfig
from trireme.errors import ConfigError
from trireme.models.attention import Attention, Rope
from trireme.models.mamba import Mamba
from trireme.models.mlp import MLP
from trireme.models.moe import MoE
from trireme.models.paged import PagedLayout
from trireme.models.sublayer import Sublayer
from trireme.ops.norms import build_norm
from trireme.ops.recompute import recompute
from trireme.parallel.context import ParallelContext
from trireme.parallel.context_parallel import ContextParallel

# kind -> its class, which takes (cfg, ctx) and declares its costs (trireme.models.sublayer).
# Every kind of trireme.config.KINDS has one (tests/test_sublayers.py) unless it is NOT_YET.
SUBLAYERS: dict[str, type[Sublayer]] = {cls.kind: cls for cls in (Attention, MLP, MoE, Mamba)}


def build_sublayer(kind: str, cfg: ModelConfig, ctx: ParallelContext) -> nn.Module:
    """The sublayer of one kind (an entry of ModelConfig.layer_kinds)."""
    if kind not in SUBLAYERS:  # a symbol of trireme.config.NOT_YET
        raise ConfigError(f"model.layer_pattern: the {kind} sublayer is not implemented yet")
    return SUBLAYERS[kind](cfg, ctx)


def sublayer_names(kinds: tuple[str, ...]) -> list[str]:
    """Module names of a layer's sublayers, e.g. ("attention", "mlp") -> ["attention", "mlp"]
    and ("attention", "mlp", "mlp") -> ["attention", "mlp", "mlp_1"]."""
    names: list[str] = []
    for kind in kinds:
        count = sum(n == kind or n.startswith(f"{kind}_") for n in names)
        names.append(kind if count == 0 else f"{kind}_{count}")
    return names


class Block(nn.Module):
    """One layer: its sublayers (`kinds`, e.g. ("attention", "mlp")) in order, each after its
    own norm."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext,
                 kinds: tuple[str, ...] = ("attention", "mlp")) -> None:
        super().__init__()
        self.sublayers = tuple(sublayer_names(kinds))
        for name, kind in zip(self.sublayers, kinds):  # registration order: norm, sublayer
            self.add_module(f"{name}_norm", build_norm(cfg.normalization, cfg.hidden_size,
                                                       cfg.norm_eps, cfg.bias, cfg.kernels))
            self.add_module(name, build_sublayer(kind, cfg, ctx))
        self.recompute = False  # full recomputation: see set_recompute
        self.random = cfg.dropout > 0.0
        self.rng = ctx.head_rng

    def set_recompute(self, full: bool, selective: bool) -> None:
        """`full`: keep only the block's input, rerun the whole block in the backward;
        `selective`: each sublayer reruns what it says it may (its `set_recompute`)."""
        self.recompute = full
        for name in self.sublayers:
            getattr(self, name).set_recompute(selective)

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype, paged: PagedLayout) -> dict[str, Any]:
        """Each sublayer's decoding state, by name (sublayers that keep none are left out):
        sublayers that page (attention) take their pool of the `paged` layout; the others keep
        `batch_size` rows (one per request slot of the serving engine)."""
        states = {}
        for name in self.sublayers:
            sublayer = getattr(self, name)
            if getattr(sublayer, "pages", False):
                states[name] = sublayer.new_cache(batch_size, max_len, device, dtype, paged=paged)
            else:
                states[name] = sublayer.new_cache(batch_size, max_len, device, dtype)
        return {name: state for name, state in states.items() if state is not None}

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        cache: dict[str, Any] | None = None,
        document_ids: torch.Tensor | None = None,
        context: ContextParallel | None = None,
    ) -> torch.Tensor:
        if self.recompute and cache is None and torch.is_grad_enabled():
            # keep only x: the whole block runs again in the backward. Inside forward, so that
            # a compiled block (block.compile()) compiles the checkpoint with it.
            return recompute(self.layer, x, rope, document_ids=document_ids, context=context,
                             random=self.random and self.training, rngs=[self.rng])
        return self.layer(x, rope, cache, document_ids, context)

    def layer(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        cache: dict[str, Any] | None = None,
        document_ids: torch.Tensor | None = None,
        context: ContextParallel | None = None,
    ) -> torch.Tensor:
        """The sublayers in order; `context`: x is this context-parallel rank's share of the
        sequence (the mixers attend across the context group)."""
        for name in self.sublayers:
            sublayer, h = getattr(self, name), getattr(self, f"{name}_norm")(x)
            if sublayer.mixes:
                state = cache.get(name) if cache is not None else None
                x = x + sublayer(h, rope, state, document_ids, context)
            else:
                x = x + sublayer(h)
        return x
