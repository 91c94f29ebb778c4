"""The GPT family: one decoder-only transformer for GPT-2 and Llama shapes.

    x = embedding(ids) (+ position_embedding(positions))           [b, s, h]
    for each block:
        x = x + attention(attention_norm(x))
        x = x + mlp(mlp_norm(x))
    logits = output(final_norm(x))[..., :vocab_size]                 [b, s, vocab]

The config picks learned or rotary positions, LayerNorm or RMSNorm, GeLU or SwiGLU, MHA / GQA / MQA,
QK-norm, biases and tied embeddings. Activations are [b, s, h] (batch first).

Fused weights, and their row layout (what a converter or a tensor-parallel split must respect):
- `attention.qkv.weight` is [(n_heads + 2 * n_kv) * d, h]: rows [all q heads; all k heads; all v
  heads], each part head-major (head 0's d rows, then head 1's, ...).
- SwiGLU's `mlp.fc1.weight` is [2 * ffn, h]: rows [gate; up]; GeLU's is [ffn, h].
The embedding (and an untied output layer) has cfg.padded_vocab_size rows; the rows past
cfg.vocab_size are padding, never seen in logits, the loss or sampling.

Tensor parallelism (`tp`, trireme.parallel.tensor): the same code, built from parallel layers
(column-parallel qkv and fc1, row-parallel out and fc2, vocabulary-parallel embedding and output)
that hold this rank's heads, features and vocabulary rows; with sequence parallelism the residual
stream between them is this rank's [b, s / T, h] chunk of the sequence. At tp=None (one rank) they
are the plain torch layers.

Pipeline parallelism (`stage`, a trireme.models.stages.StageSpec): the model holds only the
layers of one stage, under their global names; the first stage has the embedding, the last the final
norm, the output layer and the loss. A stage other than the first takes the previous stage's
activations as `hidden`; one other than the last returns its activations.

Memory savers (both keep the plain path): `GPT.set_recompute` recomputes activations in the
backward (trireme.ops.recompute: whole blocks, or only the attention core and the MLP activation);
model.fused_cross_entropy computes the output layer and the loss in chunks of tokens
(trireme.ops.fused_cross_entropy) instead of materialising the [b, s, vocab] logits.

Speed: model.fused_swiglu runs SwiGLU's backward as one kernel (trireme.ops.swiglu; the plain
silu(gate) * up stays the reference path).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from trireme.config import ModelConfig, ParallelConfig
from trireme.errors import TriremeError
from trireme.models.init import init_parameters
from trireme.models.stages import StageSpec, rank_stages
from trireme.ops.attention import attention
from trireme.ops.cross_entropy import cross_entropy
from trireme.ops.fused_cross_entropy import fused_linear_cross_entropy
from trireme.ops.norms import RMSNorm, build_norm
from trireme.ops.recompute import MODES as RECOMPUTE_MODES
from trireme.ops.recompute import recompute
from trireme.ops.rope import RotaryEmbedding, apply_rotary, rope_frequencies
from trireme.ops.swiglu import fused_swiglu, swiglu
from trireme.parallel.random import dropout, fork_rng
from trireme.parallel.tensor import TensorParallel, column_linear, row_linear
from trireme.parallel.vocab import padded_vocab_size, parallel_output, vocab_embedding

if TYPE_CHECKING:
    from trireme.inference.generate import KVCache

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [s, d] (or [b, s, d])
LayerCache = tuple[torch.Tensor, torch.Tensor]  # k, v buffers: [b, n_kv, max_len, d]

__all__ = ["GPT", "Attention", "MLP", "Block", "cross_entropy"]


class Attention(nn.Module):
    """Causal self-attention with a fused QKV projection, optional QK-norm, RoPE and KV cache.

    Under tensor parallelism this rank holds num_heads / T query heads and their key/value heads
    (num_kv / T of them, or the one they share when T > num_kv).
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        d, n_heads, n_kv = cfg.head_size, cfg.num_attention_heads, cfg.kv_heads
        tp_size = tp.size if tp is not None else 1
        self.num_heads, self.num_kv_heads, self.head_size = (
            n_heads // tp_size, max(n_kv // tp_size, 1), d,
        )
        self.backend = cfg.attention_backend
        self.dropout_p = cfg.dropout
        q_size, kv_size = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        self.split_sizes = [q_size, kv_size, kv_size]
        qkv_parts = [(n_heads, d), (n_kv, d), (n_kv, d)]  # q, k, v heads of d rows
        self.qkv = column_linear(cfg.hidden_size, qkv_parts, cfg.bias, tp)
        self.out = row_linear(n_heads * d, cfg.hidden_size, cfg.bias, tp)
        if cfg.qk_norm:  # RMSNorm over each head's d features, shared by all heads
            self.q_norm = RMSNorm(self.head_size, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_size, cfg.norm_eps)
        self.qk_norm = cfg.qk_norm
        self.head_rng = tp.rng if tp is not None else None  # heads are split: masks per rank
        self.resid_dropout = dropout(cfg.dropout, tp.residual_rng if tp is not None else None)
        self.recompute_core = False  # selective recomputation (GPT.set_recompute)

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        qkv = self.qkv(x)  # [b, s, (n_heads + 2 * n_kv) * d]
        if self.recompute_core and cache is None and torch.is_grad_enabled():
            # keep qkv only; RoPE'd q, k and the kernel's statistics are rebuilt in the backward
            random = self.training and self.dropout_p > 0.0
            y = recompute(self.core, qkv, rope, document_ids=document_ids, random=random,
                          rngs=[self.head_rng])
        else:
            y = self.core(qkv, rope, cache, start_pos, document_ids)
        return self.resid_dropout(self.out(y))

    def core(
        self,
        qkv: torch.Tensor,
        rope: Rope | None = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[b, s, n_heads * d]: attention over the projected q, k, v (QK-norm, RoPE, kernel)."""
        d = self.head_size
        q, k, v = qkv.split(self.split_sizes, dim=-1)  # [b, s, heads * d] each
        b, s, _ = q.shape  # the whole sequence (under SP, x was this rank's chunk of it)
        q = q.view(b, s, self.num_heads, d).transpose(1, 2)  # [b, n_heads, s, d]
        k = k.view(b, s, self.num_kv_heads, d).transpose(1, 2)  # [b, n_kv, s, d]
        v = v.view(b, s, self.num_kv_heads, d).transpose(1, 2)  # [b, n_kv, s, d]
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        if cache is not None:  # store this chunk's keys/values, attend over everything so far
            k_cache, v_cache = cache
            end = start_pos + s
            k_cache[:b, :, start_pos:end] = k
            v_cache[:b, :, start_pos:end] = v
            k, v = k_cache[:b, :, :end], v_cache[:b, :, :end]  # [b, n_kv, end, d]
        dropout_p = self.dropout_p if self.training else 0.0
        with fork_rng(self.head_rng, dropout_p > 0.0):
            y = attention(
                q, k, v, causal=True, backend=self.backend, dropout_p=dropout_p,
                q_offset=start_pos, document_ids=document_ids,
            )  # [b, n_heads, s, d]
        return y.transpose(1, 2).reshape(b, s, self.num_heads * d)  # [b, s, n_heads * d]


class MLP(nn.Module):
    """SwiGLU: fc2(silu(gate) * up) with fc1 = [gate; up]; or GeLU: fc2(gelu_tanh(fc1(x)))."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.swiglu = cfg.activation == "swiglu"
        self.fused_swiglu = self.swiglu and cfg.fused_swiglu  # trireme.ops.swiglu
        fc1_parts = [(cfg.ffn_size, 1)] * (2 if self.swiglu else 1)  # gate and up split alike
        self.fc1 = column_linear(cfg.hidden_size, fc1_parts, cfg.bias, tp)
        self.fc2 = row_linear(cfg.ffn_size, cfg.hidden_size, cfg.bias, tp)
        self.resid_dropout = dropout(cfg.dropout, tp.residual_rng if tp is not None else None)
        self.recompute_activation = False  # selective recomputation (GPT.set_recompute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)  # [b, s, 2 * ffn] (SwiGLU) or [b, s, ffn]
        # SwiGLU keeps silu(gate) ([b, s, ffn]) for its backward: recomputing it saves that.
        # (GeLU's backward needs only its input, which fc1's output is anyway: nothing to save;
        # nor does the fused SwiGLU, which keeps only h, as the recomputation would.)
        recompute_swiglu = self.swiglu and not self.fused_swiglu
        if self.recompute_activation and recompute_swiglu and torch.is_grad_enabled():
            h = recompute(self.activation, h)
        else:
            h = self.activation(h)
        return self.resid_dropout(self.fc2(h))

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.fused_swiglu:  # the same forward; the backward as one kernel on CUDA
            return fused_swiglu(h)
        if self.swiglu:
            return swiglu(h)  # silu(gate) * up, gate and up [b, s, ffn] halves of h
        return F.gelu(h, approximate="tanh")


class Block(nn.Module):
    """One pre-norm transformer layer."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None) -> None:
        super().__init__()
        self.attention_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_eps, cfg.bias)
        self.attention = Attention(cfg, tp)
        self.mlp_norm = build_norm(cfg.normalization, cfg.hidden_size, cfg.norm_eps, cfg.bias)
        self.mlp = MLP(cfg, tp)
        self.recompute = False  # full recomputation (GPT.set_recompute)
        self.random = cfg.dropout > 0.0
        self.rng = tp.rng if tp is not None else None

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.recompute and cache is None and torch.is_grad_enabled():
            # keep only x: the whole block runs again in the backward. Inside forward, so that
            # a compiled block (block.compile()) compiles the checkpoint with it.
            return recompute(self.layer, x, rope, document_ids=document_ids,
                             random=self.random and self.training, rngs=[self.rng])
        return self.layer(x, rope, cache, start_pos, document_ids)

    def layer(
        self,
        x: torch.Tensor,
        rope: Rope | None = None,
        cache: LayerCache | None = None,
        start_pos: int = 0,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, cache, start_pos, document_ids)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class GPT(nn.Module):
    """Decoder-only transformer LM (GPT-2 and Llama families) described by a `ModelConfig`.

    `GPT(cfg)` initializes with `init_parameters(model, seed)` (a function of seed and parameter
    name only); pass `seed=None` to skip that, e.g. on the meta device or before loading weights.
    `tp` (from trireme.parallel.tensor.build_tensor_parallel) builds this rank's tensor-parallel
    shard of the model; the vocabulary is then padded to a multiple of
    make_vocab_size_divisible_by * T rows.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int | None = 0,
        tp: TensorParallel | None = None,
        stage: StageSpec | None = None,
    ) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise TriremeError("model.vocab_size must be set before building the model")
        self.cfg = cfg
        self.tp = tp
        self.stage = stage or StageSpec(0, cfg.num_layers, True, True)
        first, last = self.stage.first, self.stage.last
        h = cfg.hidden_size
        self.padded_vocab_size = padded_vocab_size(cfg, tp.size if tp is not None else 1)
        if first or (last and cfg.tie_embeddings):  # the last stage's copy is the output layer
            self.embedding = vocab_embedding(self.padded_vocab_size, h, tp)
        if cfg.position_embedding == "learned" and not first:
            self.rope = None
        elif cfg.position_embedding == "learned":
            self.position_embedding = nn.Embedding(cfg.seq_length, h)
            self.rope = None
        else:
            inv_freq = rope_frequencies(
                cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
                cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                cfg.rope_original_max_position,
            )
            self.rope = RotaryEmbedding(cfg.head_size, cfg.seq_length, inv_freq)
        # on the embeddings, the start of the residual stream
        self.dropout = dropout(cfg.dropout, tp.residual_rng if tp is not None else None)
        self.layers = nn.ModuleDict({str(i): Block(cfg, tp) for i in self.stage.layers})
        if last:
            self.final_norm = build_norm(cfg.normalization, h, cfg.norm_eps, cfg.bias)
        if last and not cfg.tie_embeddings:  # under TP: this rank's rows of the vocabulary
            self.output = column_linear(h, [(self.padded_vocab_size, 1)], False, tp)
        self._compile_pending = cfg.compile
        if seed is not None:

            init_parameters(self, seed)

    def output_weight(self) -> torch.Tensor:
        """[padded_vocab, h]: the output layer's weight, the embedding's when tied."""
        return self.embedding.weight if self.cfg.tie_embeddings else self.output.weight

    def set_recompute(self, mode: str, num_layers: int = 0) -> None:
        """Recompute activations in the backward (train.recompute): "none"; "selective" (every
        block's attention core and MLP activation); "full" (whole blocks: the first `num_layers`
        of this model's (stage's) blocks, all when 0)."""
        if mode not in RECOMPUTE_MODES:
            raise TriremeError(f"train.recompute = {mode!r} is not one of {RECOMPUTE_MODES}")
        for i, block in enumerate(self.layers.values()):
            block.recompute = mode == "full" and (num_layers == 0 or i < num_layers)
            block.attention.recompute_core = mode == "selective"
            block.mlp.recompute_activation = mode == "selective"

    def _maybe_compile(self, device: torch.device) -> None:
        # Compile each block (not the whole model): small graphs, the same one reused by every
        # layer, and parameter names unchanged (nn.Module.compile works in place). CPU: skipped.
        if self._compile_pending and device.type == "cuda":
            for block in self.layers.values():
                block.compile()
            self._compile_pending = False

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        start_pos: int = 0,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab_size] (fp32 not guaranteed), or with `labels` [b, s] the mean
        cross-entropy (fp32 scalar) over tokens with labels != -100 and loss_mask (if given) != 0.

        Packed documents (training only): `position_ids` [b, s] restart positions per document;
        `document_ids` [b, s] keep attention within each document.

        `kv_cache[i]` is layer i's (k, v) buffer pair, [b, n_kv, max_len, d]; input_ids are then
        the tokens at positions start_pos..start_pos+s-1 (see trireme.inference.generate).
        A pipeline stage other than the first takes its input activations as `hidden` (input_ids
        still give the shape); one other than the last returns its output activations [b, s, h].
        """
        b, s = input_ids.shape
        end = start_pos + s
        if self.rope is None and end > self.cfg.seq_length:
            raise TriremeError(
                f"positions up to {end} exceed model.seq_length = {self.cfg.seq_length} "
                "(learned position embeddings have no rows past it)"
            )
        if kv_cache is not None and self.tp is not None:
            raise TriremeError(
                "generation with a KV cache under tensor parallelism is not implemented yet; "
                "pass use_cache=False"
            )
        self._maybe_compile(input_ids.device)
        if (position_ids is not None or document_ids is not None) and kv_cache is not None:
            raise TriremeError("position_ids / document_ids are for training, not a KV cache")
        if not self.stage.first:  # the previous stage's activations (under SP [b, s / T, h])
            x, rope = hidden, None
            if self.rope is not None and position_ids is not None:
                rope = self.rope(input_ids.device, position_ids=position_ids)  # 2 x [b, s, d]
            elif self.rope is not None:
                rope = self.rope(input_ids.device, offset=start_pos, length=s)
            return self._blocks_and_head(
                x, rope, labels, loss_mask, kv_cache, start_pos, document_ids
            )
        x = self.embedding(input_ids)  # [b, s, h] (under SP this rank's [b, s / T, h])
        if self.rope is None:
            if position_ids is None:
                positions = torch.arange(start_pos, end, device=input_ids.device)  # [s]
                seq_dim = 0
            else:
                positions, seq_dim = position_ids, 1  # [b, s]
            if self.tp is not None:
                positions = self.tp.sequence_shard(positions, dim=seq_dim)  # [s / T] under SP
            x = x + self.position_embedding(positions)  # [b, s, h] + [s, h] (or [b, s, h])
            rope = None
        elif position_ids is not None:
            rope = self.rope(input_ids.device, position_ids=position_ids)  # 2 x [b, s, d]
        else:
            rope = self.rope(input_ids.device, offset=start_pos, length=s)  # 2 x [s, d]
        x = self.dropout(x)
        return self._blocks_and_head(x, rope, labels, loss_mask, kv_cache, start_pos, document_ids)

    def _blocks_and_head(
        self,
        x: torch.Tensor,
        rope: Rope | None,
        labels: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        kv_cache: KVCache | None,
        start_pos: int,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for name, block in self.layers.items():
            if kv_cache is None:
                x = block(x, rope, document_ids=document_ids)
            else:  # decoding: shapes change every step, so run the blocks eagerly
                x = block.forward(x, rope, kv_cache[int(name)], start_pos)
        if not self.stage.last:
            return x  # [b, s, h]: the next stage's input
        x = self.final_norm(x)
        if self.tp is not None:  # vocabulary split over the ranks: no full logits for the loss
            return parallel_output(
                x, self.output_weight(), self.tp, self.cfg.vocab_size, labels, loss_mask
            )
        if labels is not None and self.cfg.fused_cross_entropy:  # no [b, s, vocab] logits
            return fused_linear_cross_entropy(
                x, self.output_weight(), labels, loss_mask, vocab_size=self.cfg.vocab_size,
                chunk_size=self.cfg.loss_chunk_size, compile=self.cfg.compile and x.is_cuda,
            )
        logits = F.linear(x, self.output_weight())  # [b, s, padded_vocab]: a padded-size matmul
        logits = logits[..., : self.cfg.vocab_size]  # [b, s, vocab]: the padding never leaves
        if labels is None:
            return logits
        return cross_entropy(logits, labels, loss_mask)

    def num_parameters(self, exclude_embedding: bool = False) -> int:
        """Parameters (each shared tensor once); without the input token and position embeddings
        when `exclude_embedding` (a tied output layer then goes too, as it is the embedding)."""
        skip = {"embedding.weight", "position_embedding.weight"} if exclude_embedding else set()
        return sum(p.numel() for n, p in self.named_parameters() if n not in skip)


def build_stage_chunks(
    cfg: ModelConfig, pcfg: ParallelConfig, pipeline_rank: int, tp=None, seed: int | None = 0,
) -> list:
    """This pipeline rank's model chunks (GPTs holding one stage each), initialized by name."""
    return [GPT(cfg, seed=seed, tp=tp, stage=spec)
            for spec in rank_stages(cfg.num_layers, pcfg, pipeline_rank)]
