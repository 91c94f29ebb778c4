"""What a sublayer kind declares besides its forward: its costs, read off the config alone.

Every sublayer class (trireme.models.block.SUBLAYERS: attention, mlp, moe, mamba) answers, as
class methods of (ModelConfig, degrees), what the rest of trireme asks of its kind, so no instance
is built and no other file tests for its symbol:

    flops(cfg, seq_length)            forward FLOPs per token / 2, Megatron's formula: the model
                                      FLOPs of MFU (trireme.metrics) and the pipeline stage split's
                                      layer costs (trireme.models.stages)
    rank_flops(cfg, tensor)           the same on one tensor-parallel rank, as (linear layers,
                                      attention core): the planner's matmul time
    params(cfg, tensor, expert)       parameters one rank holds (its norm, the block's, not
                                      included): the planner's memory
    activation_bytes(cfg, s, mode)    bytes per token autograd keeps for the backward (its norm
                                      included) under recompute `mode`: the planner's memory
    fp8_linears(s)                    its linears that model.fp8_layers can name, with their
                                      (inputs, outputs) on this rank
    routed_copies(cfg)                rows each token sends to the expert-parallel ranks
    hf_names(cfg)                     its weights under Hugging Face's names (trireme.convert)

A kind that does not declare a cost counts nothing there (the defaults below): the planner does
not model Mamba-2's parameters and activations yet. `Shape` holds the per-rank sizes the
activation formulas read (built from a Config by trireme.plan.activations.shape_of).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from trireme.config import ModelConfig


@dataclass(frozen=True)
class Shape:
    """The per-rank sizes activations depend on."""

    e: int  # bytes per activation element
    h: int
    q: int  # query width on this TP rank
    k: int  # key/value width on this TP rank
    heads: int  # query heads on this TP rank
    ffn: int  # MLP width on this TP rank
    tensor: int
    sequence_parallel: bool
    context: int
    context_mode: str
    fp8: bool
    norm_fused: bool
    layernorm: bool
    swiglu: bool
    activation_recomputed: bool  # fused SwiGLU or a compiled block: silu(gate) not kept
    compiled: bool  # model.compile on a GPU (the CPU always runs eagerly)
    fused_loss: bool  # model.fused_cross_entropy, "auto" resolved for the device
    loss_in_place: bool = False  # its Triton softmax on a GPU: the gradient over the logits


@dataclass(frozen=True)
class Params:
    """Parameters (elements) of one sublayer on one rank: `dense` (replicated over data
    parallelism), `experts` (the routed experts, replicated over the expert-data group only) and
    `largest`, its biggest weight."""

    dense: int = 0
    experts: int = 0
    largest: int = 0


def norm_bytes(s: Shape) -> float:
    """Bytes per token one norm keeps (per token of the full micro batch on this rank)."""
    if s.layernorm:
        per = s.e * s.h + 8
    elif s.norm_fused:
        per = s.e * s.h + 4
    else:
        per = 8 * s.h + 4
    return per / (s.tensor if s.sequence_parallel else 1)


def linear_input_bytes(s: Shape) -> int:
    """Bytes per element a linear keeps of its input: e; 1 in fp8 (its quantized copy); none in
    a compiled fp8 block (recomputed from the norm's input or fc1's output,
    trireme.plan.activations)."""
    if not s.fp8:
        return s.e
    return 0 if s.compiled else 1


class Sublayer(nn.Module):
    """The base of every sublayer class: the declarations of the module docstring, with the
    defaults of a kind that does not declare them."""

    kind: ClassVar[str]  # its name (trireme.config.KINDS): the module name in the block
    symbol: ClassVar[str]  # its symbol in model.layer_pattern
    mixes: ClassVar[bool]  # whether it mixes positions (takes rope, a cache, the start position)

    @classmethod
    def flops(cls, cfg: ModelConfig, seq_length: int | None = None) -> float:
        raise NotImplementedError(f"{cls.__name__} declares no FLOPs")

    @classmethod
    def rank_flops(cls, cfg: ModelConfig, tensor: int) -> tuple[float, float]:
        """(linear layers, attention core) forward FLOPs per token / 2 on one TP rank at
        cfg.seq_length; by default the whole sublayer's, on every rank."""
        return cls.flops(cfg), 0.0

    @classmethod
    def params(cls, cfg: ModelConfig, tensor: int, expert: int) -> Params:
        return Params()

    @classmethod
    def activation_bytes(cls, cfg: ModelConfig, s: Shape, mode: str) -> float:
        return 0.0

    @classmethod
    def fp8_linears(cls, s: Shape) -> dict[str, tuple[int, int]]:
        return {}

    @classmethod
    def routed_copies(cls, cfg: ModelConfig) -> int:
        return 0

    @classmethod
    def hf_names(cls, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
        """Its weights under Hugging Face's names, as every family with this kind writes them
        (Llama, Nemotron-H): ours -> theirs, tensor names within the sublayer; a fused tensor
        lists its parts in order. A family's own names (biases, GPT-2's, the experts') stay in
        its converter."""
        return {}
