"""Parameters per rank, counted from the config (no model is built): what each pipeline rank holds
under tensor, pipeline and expert parallelism.

Per layer (h hidden, d head size, n / g query / key-value heads, F the MLP width, T tensor degree,
E experts, P expert degree), each sublayer's norm and what its class declares (`params` in
trireme.models attention.py, mlp.py, moe.py; Mamba-2's are not counted yet):

    norm          h (+ h bias for a LayerNorm with model.bias)
    attention     h * (n / T + 2 * max(g / T, 1)) * d  +  (n / T) * d * h   (+ biases, QK-norm 2d)
    MLP           h * F * (2 if SwiGLU else 1) / T  +  F / T * h            (+ biases)
    MoE           router h * E  +  experts (E / P) * 3 * h * F_moe  +  shared expert (an MLP)

and the vocabulary tables, padded to a multiple of make_vocab_size_divisible_by * T and split
over T: the embedding on the first stage (and its copy on the last when tied under pipelining),
the output layer on the last when untied, learned positions (seq * h) on the first.
A test builds the model and counts its parameters (tests/test_plan.py).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from trireme.config import ModelConfig
from trireme.models.block import SUBLAYERS
from trireme.models.stages import StageSpec
from trireme.models.sublayer import Params
from trireme.parallel.vocab import padded_vocab_size


@dataclass(frozen=True)
class RankParams:
    """Parameters (elements) one rank holds: `dense` (replicated over DP) and `experts` (the routed
    experts, replicated over the expert-data group only), plus `largest`, the biggest tensor."""

    dense: int
    experts: int
    largest: int

    @property
    def total(self) -> int:
        return self.dense + self.experts


def _norm(cfg: ModelConfig) -> int:
    h = cfg.hidden_size
    return 2 * h if cfg.normalization == "layernorm" and cfg.bias else h


def layer_params(cfg: ModelConfig, kinds: tuple[str, ...], tensor: int, expert: int) -> Params:
    """The parameters of one layer with sublayers `kinds` on one rank: each one's norm and what
    its class declares (`params`, trireme.models.sublayer); `largest` the biggest weight."""
    dense, experts, largest = 0, 0, 0
    for kind in kinds:
        p = SUBLAYERS[kind].params(cfg, tensor, expert)
        dense, experts = dense + _norm(cfg) + p.dense, experts + p.experts
        largest = max(largest, p.largest)
    return Params(dense, experts, largest)


def stage_params(cfg: ModelConfig, stage: StageSpec, tensor: int, expert: int,
                 pipelined: bool) -> RankParams:
    """The parameters of one pipeline stage (one model chunk) on one rank."""
    h = cfg.hidden_size
    vocab = padded_vocab_size(cfg, tensor) // tensor * h
    dense, experts, largest = 0, 0, 0
    if stage.first or (stage.last and cfg.tie_embeddings and pipelined):
        dense += vocab
        largest = vocab
    if stage.first and cfg.position_embedding == "learned":
        dense += cfg.seq_length * h
    layers = cfg.layer_kinds
    for kinds, count in Counter(layers[i] for i in stage.layers).items():  # alike layers once
        p = layer_params(cfg, kinds, tensor, expert)
        dense, experts = dense + count * p.dense, experts + count * p.experts
        largest = max(largest, p.largest)
    if stage.last:
        dense += _norm(cfg)
        if not cfg.tie_embeddings:
            dense += vocab
            largest = max(largest, vocab)
    return RankParams(dense, experts, largest)


def total_params(cfg: ModelConfig) -> int:
    """Every parameter of the model, counted once (tied embeddings once)."""
    stage = StageSpec(0, cfg.num_layers, True, True)
    return stage_params(cfg, stage, 1, 1, False).total


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token goes through: the routed experts counted top_k / E of them."""
    stage = StageSpec(0, cfg.num_layers, True, True)
    p = stage_params(cfg, stage, 1, 1, False)
    return p.dense + p.experts * cfg.moe_top_k // max(cfg.moe_num_experts, 1)
