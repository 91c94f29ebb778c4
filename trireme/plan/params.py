"""Parameters per rank, counted from the config (no model is built): what each pipeline rank holds
under tensor, pipeline and expert parallelism.

Per layer (h hidden, d head size, n / g query / key-value heads, F the MLP width, T tensor degree,
E experts, P expert degree), matching trireme.models (attention.py, mlp.py, moe.py):

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

from torch.utils.weak import WeakIdKeyDictionary

from trireme.config import ModelConfig
from trireme.models.block import sublayer_names
from trireme.models.stages import StageSpec
from trireme.parallel.vocab import padded_vocab_size

_SYMBOLS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def layer_symbols(cfg: ModelConfig) -> list[str]:
    """cfg.layer_symbols, parsed once per model config (the planner asks thousands of times)."""
    if cfg not in _SYMBOLS:
        _SYMBOLS[cfg] = cfg.layer_symbols
    return _SYMBOLS[cfg]


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


def attention_params(cfg: ModelConfig, tensor: int) -> int:
    h, d = cfg.hidden_size, cfg.head_size
    heads, kv = cfg.num_attention_heads // tensor, max(cfg.kv_heads // tensor, 1)
    qkv_rows = (heads + 2 * kv) * d
    qkv = h * qkv_rows + (qkv_rows if cfg.bias or cfg.qkv_bias else 0)
    out = heads * d * h + (h if cfg.bias else 0)
    return qkv + out + (2 * d if cfg.qk_norm else 0)


def mlp_params(cfg: ModelConfig, tensor: int, ffn: int | None = None, swiglu: bool | None = None
               ) -> int:
    h, f = cfg.hidden_size, (ffn or cfg.ffn_size) // tensor
    gated = cfg.activation == "swiglu" if swiglu is None else swiglu
    fc1 = h * f * (2 if gated else 1) + (f * (2 if gated else 1) if cfg.bias else 0)
    return fc1 + f * h + (h if cfg.bias else 0)


def moe_params(cfg: ModelConfig, tensor: int, expert: int) -> tuple[int, int]:
    """(dense, routed experts) of one MoE sublayer on one rank."""
    h = cfg.hidden_size
    dense = h * cfg.moe_num_experts
    if cfg.moe_shared_ffn_hidden_size:
        dense += mlp_params(cfg, tensor, cfg.moe_shared_ffn_hidden_size, swiglu=True)
    return dense, cfg.moe_num_experts // expert * 3 * h * cfg.moe_ffn_size


def layer_params(cfg: ModelConfig, symbols: str, tensor: int, expert: int) -> tuple[int, int]:
    """(dense, experts) parameters of one layer with sublayers `symbols` (e.g. "*-")."""
    dense, experts = 0, 0
    for symbol in symbols:
        dense += _norm(cfg)
        if symbol == "*":
            dense += attention_params(cfg, tensor)
        elif symbol == "-":
            dense += mlp_params(cfg, tensor)
        elif symbol == "E":
            d, e = moe_params(cfg, tensor, expert)
            dense, experts = dense + d, experts + e
    return dense, experts


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
    symbols = layer_symbols(cfg)
    for kind, count in Counter(symbols[i] for i in stage.layers).items():  # alike layers once
        d, e = layer_params(cfg, kind, tensor, expert)
        dense, experts = dense + count * d, experts + count * e
        largest = max(largest, _largest_in_layer(cfg, kind, tensor, expert))
    if stage.last:
        dense += _norm(cfg)
        if not cfg.tie_embeddings:
            dense += vocab
            largest = max(largest, vocab)
    return RankParams(dense, experts, largest)


def _largest_in_layer(cfg: ModelConfig, symbols: str, tensor: int, expert: int) -> int:
    h, d = cfg.hidden_size, cfg.head_size
    heads, kv = cfg.num_attention_heads // tensor, max(cfg.kv_heads // tensor, 1)
    sizes = [h * (heads + 2 * kv) * d]
    if "-" in symbols:
        sizes.append(h * cfg.ffn_size // tensor * (2 if cfg.activation == "swiglu" else 1))
    if "E" in symbols:
        sizes.append(cfg.moe_num_experts // expert * 2 * h * cfg.moe_ffn_size)
    assert sublayer_names(symbols)  # every symbol is a known sublayer
    return max(sizes)


def total_params(cfg: ModelConfig) -> int:
    """Every parameter of the model, counted once (tied embeddings once)."""
    stage = StageSpec(0, cfg.num_layers, True, True)
    return stage_params(cfg, stage, 1, 1, False).total


def active_params(cfg: ModelConfig) -> int:
    """Parameters one token goes through: the routed experts counted top_k / E of them."""
    stage = StageSpec(0, cfg.num_layers, True, True)
    p = stage_params(cfg, stage, 1, 1, False)
    return p.dense + p.experts * cfg.moe_top_k // max(cfg.moe_num_experts, 1)
