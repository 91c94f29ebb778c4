"""The `*` sublayer: causal self-attention with a fused QKV projection, QK-norm, RoPE, paged KV.

    qkv = x W_qkv                       [b, s, (n_heads + 2 * n_kv) * d]
    q, k, v = split(qkv) per head        [b, heads, s, d]
    y = softmax(q k^T / sqrt(d) + causal) v, then y W_out

`qkv.weight` is [(n_heads + 2 * n_kv) * d, h]: rows [all q heads; all k heads; all v heads], each
part head-major (what a converter or a tensor-parallel split must respect). Under tensor
parallelism this rank holds num_heads / T query heads and their key/value heads (num_kv / T of
them, or the one they share when T > num_kv); qkv is column-parallel and out row-parallel.
"""

from __future__ import annotations

import torch

from trireme.config import ModelConfig
from trireme.models.init import InitRule
from trireme.models.paged import PagedKV, PagedLayout
from trireme.models.sublayer import Params, Shape, Sublayer, linear_input_bytes, norm_bytes
from trireme.ops.attention import attention
from trireme.ops.attention_fa4 import require_fa4
from trireme.ops.norms import RMSNorm
from trireme.ops.recompute import recompute
from trireme.ops.rope import apply_rotary, apply_rotary_tokens
from trireme.parallel.context import ParallelContext
from trireme.parallel.context_parallel import ContextParallel, context_attention
from trireme.parallel.random import dropout, fork_rng
from trireme.parallel.tensor import column_linear, row_linear

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [s, d] (or [b, s, d])


class Attention(Sublayer):
    """Causal self-attention (module docstring). A mixer: it sees positions, and keeps a cache."""

    kind = "attention"
    symbol = "*"
    mixes = True
    pages = True  # its cache can live in a paged pool (trireme.models.paged)
    causal = True  # the vision encoder's subclass attends both ways (trireme.models.vision)

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        d, n_heads, n_kv = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
        tp_size = ctx.size("tensor")
        self.num_heads, self.num_kv_heads, self.head_size = (
            n_heads // tp_size, max(n_kv // tp_size, 1), d,
        )
        self.backend = cfg.attention_backend
        if self.backend == "fa4":
            require_fa4()  # the one-line ConfigError now, not at the first step
        # decoding (KV cache, paged pools) keeps SDPA's choice: fa4 covers training's calls
        self.decode_backend = "auto" if self.backend == "fa4" else self.backend
        self.dropout_p = cfg.dropout
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_parts = (("q", n_heads * d), ("k", n_kv * d), ("v", n_kv * d))  # full rows
        self.qkv = column_linear(cfg.hidden_size, [(n_heads, d), (n_kv, d), (n_kv, d)],
                                 cfg.bias or cfg.qkv_bias, ctx.tensor)
        self.out = row_linear(n_heads * d, cfg.hidden_size, cfg.bias, ctx.tensor)
        if cfg.qk_norm:  # RMSNorm over each head's d features, shared by all heads
            self.q_norm = RMSNorm(self.head_size, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_size, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.head_rng = ctx.head_rng  # heads are split: dropout masks per rank
        self.resid_dropout = dropout(cfg.dropout, ctx.residual_rng)
        self.recompute_core = False  # selective recomputation: see set_recompute

    def init_rules(self) -> dict[str, InitRule]:
        return {"qkv.weight": InitRule(parts=self.qkv_parts),
                "out.weight": InitRule(residual_output=True)}

    # What the rest of trireme asks of the kind (trireme.models.sublayer)

    @classmethod
    def flops(cls, cfg: ModelConfig, seq_length: int | None = None) -> float:
        """Projections h (q + 2 kv) + q h, scores and values q s (halved for the causal mask)."""
        h, s = cfg.hidden_size, seq_length or cfg.seq_length
        q, kv = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
        return h * (q + 2 * kv) + q * h + q * s

    @classmethod
    def rank_flops(cls, cfg: ModelConfig, tensor: int) -> tuple[float, float]:
        core = cfg.num_attention_heads * cfg.head_size * cfg.seq_length
        return (cls.flops(cfg) - core) / tensor, core / tensor

    @classmethod
    def params(cls, cfg: ModelConfig, tensor: int, expert: int) -> Params:
        """qkv (this rank's heads and their key/value heads, or the one they share), out, the
        biases and QK-norm's two d-wide weights."""
        h, d = cfg.hidden_size, cfg.head_size
        heads, kv = cfg.num_attention_heads // tensor, max(cfg.kv_heads // tensor, 1)
        qkv_rows = (heads + 2 * kv) * d
        qkv = h * qkv_rows + (qkv_rows if cfg.bias or cfg.qkv_bias else 0)
        out = heads * d * h + (h if cfg.bias else 0)
        return Params(dense=qkv + out + (2 * d if cfg.qk_norm else 0), largest=h * qkv_rows)

    @classmethod
    def activation_bytes(cls, cfg: ModelConfig, s: Shape, mode: str) -> float:
        """norm + qkv's input h + qkv (q + 2k) (+ the gathered K and V of the other context
        ranks); then selective: out's input (q); none: RoPE'd q and k (q + k), the kernel's
        output (q, also out's input) and its log-sum-exp (4 per head); fp8 keeps out's input
        twice (+ q bytes)."""
        lin = linear_input_bytes(s)  # qkv's kept input
        base = norm_bytes(s) + lin * s.h + s.e * (s.q + 2 * s.k)
        if s.context > 1 and s.context_mode == "allgather":
            base += s.e * 2 * s.k * (s.context - 1)  # the gathered K and V of the other ranks
        if mode == "selective":
            return base + s.e * s.q + (s.q if s.fp8 else 0)
        core = s.e * (s.q + s.k) + s.e * s.q + 4 * s.heads
        return base + core + (s.q if s.fp8 else 0)

    @classmethod
    def fp8_linears(cls, s: Shape) -> dict[str, tuple[int, int]]:
        return {"qkv": (s.h, s.q + 2 * s.k), "out": (s.q, s.h)}

    @classmethod
    def hf_names(cls, cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
        """qkv is Hugging Face's q, k and v projections stacked ([all q; all k; all v])."""
        names = {"qkv.weight": ("q_proj.weight", "k_proj.weight", "v_proj.weight"),
                 "out.weight": ("o_proj.weight",)}
        if cfg.qk_norm:
            names.update({"q_norm.weight": ("q_norm.weight",), "k_norm.weight": ("k_norm.weight",)})
        return names

    def set_recompute(self, selective: bool) -> None:
        """Selective recomputation keeps only qkv: RoPE'd q, k and the kernel's statistics are
        rebuilt in the backward."""
        self.recompute_core = selective

    def new_cache(self, batch_size: int, max_len: int, device: torch.device,
                  dtype: torch.dtype, paged: PagedLayout) -> PagedKV:
        """Zeroed key and value pools of blocks (`paged`), shared by the requests of a serving
        engine."""
        return PagedKV(paged, self.num_kv_heads, self.head_size, device, dtype)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        cache: PagedKV | None = None,
        document_ids: torch.Tensor | None = None,
        context: ContextParallel | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, (n_heads + 2 * n_kv) * d]
        if self.recompute_core and cache is None and torch.is_grad_enabled():
            random = self.training and self.dropout_p > 0.0
            y = recompute(self.core, qkv, rope, document_ids=document_ids, context=context,
                          random=random, rngs=[self.head_rng])
        else:
            y = self.core(qkv, rope, cache, document_ids, context)
        return self.resid_dropout(self.out(y))

    def heads(self, qkv: torch.Tensor, rope: Rope | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [b, n_heads, s, d], k, v [b, n_kv, s, d] of qkv [b, s, ...]: split per head,
        QK-norm, RoPE of q and k. Without QK-norm q and k are RoPE'd together, as one
        [b, s, n_heads + n_kv, d] view of qkv's first columns: half the elementwise kernels of
        rotating each (eager prompt steps launch ~6 fewer per layer), the same values."""
        d = self.head_size
        b, s, _ = qkv.shape
        h, n_kv = self.num_heads, self.num_kv_heads
        q, k, v = qkv.split(self.split_sizes, dim=-1)  # [b, s, heads * d] each
        v = v.view(b, s, n_kv, d).transpose(1, 2)  # [b, n_kv, s, d]
        if rope is not None and not self.qk_norm:
            qk = apply_rotary_tokens(qkv[..., : (h + n_kv) * d].view(b, s, h + n_kv, d), *rope)
            return qk[:, :, :h].transpose(1, 2), qk[:, :, h:].transpose(1, 2), v
        q = q.view(b, s, h, d).transpose(1, 2)  # [b, n_heads, s, d]
        k = k.view(b, s, n_kv, d).transpose(1, 2)  # [b, n_kv, s, d]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        return q, k, v

    def core(
        self,
        qkv: torch.Tensor,
        rope: Rope | None = None,
        cache: PagedKV | None = None,
        document_ids: torch.Tensor | None = None,
        context: ContextParallel | None = None,
    ) -> torch.Tensor:
        """[b, s, n_heads * d]: attention over the projected q, k, v (QK-norm, RoPE, kernel);
        with `context`, q, k, v are this rank's share of the sequence and attend across the
        context group (trireme.parallel.context_parallel)."""
        d = self.head_size
        b, s, _ = qkv.shape  # the whole sequence (under SP, x was this rank's chunk of it)
        q, k, v = self.heads(qkv, rope)
        if cache is not None:  # a ragged batch of many requests (models/paged.py)
            y = cache.attend(q, k, v, self.decode_backend)  # [1, n_heads, T, d]
            return y.transpose(1, 2).reshape(b, s, self.num_heads * d)
        dropout_p = self.dropout_p if self.training else 0.0
        if context is not None:
            y = context_attention(q, k, v, context, document_ids)
            return y.transpose(1, 2).reshape(b, s, self.num_heads * d)
        with fork_rng(self.head_rng, dropout_p > 0.0):
            y = attention(
                q, k, v, causal=self.causal, backend=self.backend, dropout_p=dropout_p,
                document_ids=document_ids,
            )  # [b, n_heads, s, d]
        return y.transpose(1, 2).reshape(b, s, self.num_heads * d)  # [b, s, n_heads * d]
