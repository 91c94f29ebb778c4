"""The GPT family: one decoder-only model for GPT-2 and Llama shapes, layers from a pattern.

    x = embedding(ids) (+ position_embedding(positions))           [b, s, h]
    for each layer (trireme.models.block, sublayers from model.layer_pattern, "*-" by default):
        x = x + attention(attention_norm(x))
        x = x + mlp(mlp_norm(x))
    logits = output(final_norm(x))[..., :vocab_size]                 [b, s, vocab]

The config picks learned, rotary or no positions, LayerNorm or RMSNorm, GeLU, SwiGLU or squared
ReLU, MHA / GQA / MQA,
QK-norm, biases and tied embeddings. Activations are [b, s, h] (batch first). The sublayers and
their fused weights' row layouts: trireme/models/attention.py and mlp.py.
The embedding (and an untied output layer) has cfg.padded_vocab_size rows; the rows past
cfg.vocab_size are padding, never seen in logits, the loss or sampling.

Parallelism comes in through one `ParallelContext` (trireme.parallel.context): under tensor
parallelism the layers are the column / row / vocabulary-parallel ones that hold this rank's heads,
features and vocabulary rows; with sequence parallelism the residual stream between them is this
rank's [b, s / T, h] chunk of the sequence. The single-process context gives plain torch layers.

Pipeline parallelism (`stage`, a trireme.models.stages.StageSpec): the model holds only the
layers of one stage, under their global names; the first stage has the embedding, the last the final
norm, the output layer and the loss. A stage other than the first takes the previous stage's
activations as `hidden`; one other than the last returns its activations.

Memory savers (both keep the plain path): `GPT.set_recompute` recomputes activations in the
backward (trireme.ops.recompute: whole blocks, or what each sublayer allows); model.
fused_cross_entropy computes the output layer and the loss in chunks of tokens
(trireme.ops.fused_cross_entropy) instead of materialising the [b, s, vocab] logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trireme.config import FP8_OUTPUT, ModelConfig, ParallelConfig
from trireme.errors import TriremeError
from trireme.models.attention import Rope
from trireme.models.block import Block
from trireme.models.init import InitRule, init_parameters
from trireme.models.moe import MoE
from trireme.models.paged import PagedCache
from trireme.models.stages import StageSpec, rank_stages
from trireme.models.vision import ImageRows, Projector, VisionEncoder, merge_images
from trireme.ops.cross_entropy import cross_entropy
from trireme.ops.fused_cross_entropy import fused_linear_cross_entropy
from trireme.ops.liger import liger_linear_cross_entropy, liger_loss_applies, require_liger
from trireme.ops.norms import build_norm
from trireme.ops.recompute import MODES as RECOMPUTE_MODES
from trireme.ops.rope import RotaryEmbedding, rope_frequencies
from trireme.parallel.context import ParallelContext
from trireme.parallel.context_parallel import ContextParallel, context_loss_scale
from trireme.parallel.random import dropout
from trireme.parallel.tensor import TensorParallel, column_linear
from trireme.parallel.vocab import padded_vocab_size, parallel_output, vocab_embedding

__all__ = ["GPT", "build_stage_chunks"]


class GPT(nn.Module):
    """Decoder-only transformer LM (GPT-2 and Llama families) described by a `ModelConfig`.

    `GPT(cfg)` initializes with `init_parameters(model, seed)` (a function of seed and parameter
    name only); pass `seed=None` to skip that, e.g. on the meta device or before loading weights.
    `ctx` (trireme.parallel.context.build_parallel_context) builds this rank's tensor-parallel
    shard of the model; the vocabulary is then padded to a multiple of
    make_vocab_size_divisible_by * T rows.
    """

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        seed: int | None = 0,
        ctx: ParallelContext | None = None,
        stage: StageSpec | None = None,
    ) -> None:
        super().__init__()
        if cfg.vocab_size < 1:
            raise TriremeError("model.vocab_size must be set before building the model")
        self.cfg = cfg
        self.ctx = ctx = ctx or ParallelContext()
        self.stage = stage or StageSpec(0, cfg.num_layers, True, True)
        first, last = self.stage.first, self.stage.last
        h = cfg.hidden_size
        tp = ctx.tensor
        self.padded_vocab_size = padded_vocab_size(cfg, ctx.size("tensor"))
        if first or (last and cfg.tie_embeddings):  # the last stage's copy is the output layer
            self.embedding = vocab_embedding(self.padded_vocab_size, h, tp)
        if first and cfg.vision_layers:  # LLaVA-style: the image side lives on the first stage
            if ctx.context is not None or (tp is not None and tp.sequence_parallel):
                raise TriremeError("model.vision_layers > 0 does not support parallel.context > 1 "
                                   "or parallel.sequence_parallel yet; turn them off")
            self.vision = VisionEncoder(cfg, ctx)
            self.projector = Projector(cfg, ctx)
        self.rope = None  # learned positions (on the first stage), or none at all
        if cfg.position_embedding == "learned" and first:
            self.position_embedding = nn.Embedding(cfg.seq_length, h)
        elif cfg.position_embedding == "rope":
            inv_freq = rope_frequencies(
                cfg.head_size, cfg.rope_theta, cfg.rope_scaling, cfg.rope_scaling_factor,
                cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                cfg.rope_original_max_position,
            )
            self.rope = RotaryEmbedding(cfg.head_size, cfg.seq_length, inv_freq)
        # on the embeddings, the start of the residual stream
        self.dropout = dropout(cfg.dropout, ctx.residual_rng)
        kinds = cfg.layer_kinds  # each layer's sublayers, e.g. ("attention", "mlp")
        self.layers = nn.ModuleDict({str(i): Block(cfg, ctx, kinds[i])
                                     for i in self.stage.layers})
        if last:
            self.final_norm = build_norm(cfg.normalization, h, cfg.norm_eps, cfg.bias,
                                         cfg.kernels)
        if last and not cfg.tie_embeddings:  # under TP: this rank's rows of the vocabulary
            self.output = column_linear(h, [(self.padded_vocab_size, 1)], False, tp)
        self._compile_pending = cfg.compile
        self.liger_loss = last and "liger_cross_entropy" in cfg.kernels  # trireme.ops.liger
        if self.liger_loss:
            require_liger("liger_cross_entropy")  # the one-line ConfigError at build
        if seed is not None:
            init_parameters(self, seed)

    @property
    def tp(self) -> TensorParallel | None:
        """The tensor-parallel state of this rank (None at tensor = 1)."""
        return self.ctx.tensor

    def init_rules(self) -> dict[str, InitRule]:
        """The vocabulary tables: only the real rows are drawn, the padding stays 0."""
        table = InitRule(vocab_rows=self.cfg.vocab_size)
        return {f"{name}.weight": table for name in ("embedding", "output") if hasattr(self, name)}

    def start_step(self, loss_scale: torch.Tensor) -> None:
        """Before a training step (the step runner calls it): the MoE sublayers take the loss
        scale over the micro batches, the gradient their balancing losses get
        (trireme.models.moe), and start counting their load afresh."""
        for module in self.moe_sublayers().values():
            module.start_step(loss_scale)

    def after_step(self) -> dict[str, dict[str, torch.Tensor]]:
        """After each optimizer step: the MoE sublayers move their selection bias and report
        their routing (module name -> device scalars); {} without MoE."""
        return {name: module.after_step() for name, module in self.moe_sublayers().items()}

    def moe_sublayers(self) -> dict[str, MoE]:
        """This model's (stage's) MoE sublayers by module name, found once (the steps ask for
        them every time)."""
        if not hasattr(self, "_moe_sublayers"):
            self._moe_sublayers = {name: module for name, module in self.named_modules()
                                   if isinstance(module, MoE)}
        return self._moe_sublayers

    def output_weight(self) -> torch.Tensor:
        """[padded_vocab, h]: the output layer's weight, the embedding's when tied."""
        return self.embedding.weight if self.cfg.tie_embeddings else self.output.weight

    def _fp8_output(self) -> str:
        """The fused loss's `fp8` mode: "off" unless model.fp8_layers names "output" (or is
        "auto", which takes it wherever the fused loss runs)."""
        if self.cfg.precision != "fp8" or FP8_OUTPUT not in self.cfg.fp8_layer_names():
            return "off"
        return "emulate" if self.cfg.fp8_emulate else "on"

    def set_recompute(self, mode: str, num_layers: int = 0) -> None:
        """Recompute activations in the backward (train.recompute): "none"; "selective" (every
        block's attention core and MLP activation); "full" (whole blocks: the first `num_layers`
        of this model's (stage's) blocks, all when 0)."""
        if mode not in RECOMPUTE_MODES:
            raise TriremeError(f"train.recompute = {mode!r} is not one of {RECOMPUTE_MODES}")
        for i, block in enumerate(self.layers.values()):
            block.set_recompute(full=mode == "full" and (num_layers == 0 or i < num_layers),
                                selective=mode == "selective")

    def _maybe_compile(self, device: torch.device) -> None:
        # Compile each block (not the whole model): small graphs, the same one reused by every
        # layer, and parameter names unchanged (nn.Module.compile works in place). CPU: skipped.
        # Only when training: generation and serving (eval mode, a new shape every step) stay
        # eager unless they compile themselves.
        if self._compile_pending and device.type == "cuda" and self.training:
            vision = self.vision.layers.values() if hasattr(self, "vision") else []
            mode = None if self.cfg.compile_mode == "default" else self.cfg.compile_mode
            for block in [*self.layers.values(), *vision]:
                block.compile(mode=mode)
            self._compile_pending = False

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *,
        loss_mask: torch.Tensor | None = None,
        kv_cache: PagedCache | None = None,
        position_ids: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        context_split: bool = False,
        output_index: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
        image_rows: ImageRows | None = None,
    ) -> torch.Tensor:
        """Logits [b, s, vocab_size] (fp32 not guaranteed), or with `labels` [b, s] the mean
        cross-entropy (fp32 scalar) over tokens with labels != -100 and loss_mask (if given) != 0.

        Packed documents (training only): `position_ids` [b, s] restart positions per document;
        `document_ids` [b, s] keep attention within each document.

        A pipeline stage other than the first takes its input activations as `hidden` (input_ids
        still give the shape); one other than the last returns its output activations [b, s, h].

        Decoding (the serving engine, trireme.models.paged): `kv_cache`, a PagedCache, takes the
        tokens of many requests packed as input_ids [1, T] with their `position_ids` [1, T];
        `output_index` [n] picks the token positions whose logits are wanted ([1, n, vocab]).

        `images` [b_img, 3, H, W] (normalized pixels; a vision model, first stage): their
        projected features replace the model.image_token_id placeholders of `input_ids` in order,
        num_image_tokens(cfg) per image (trireme.models.vision). Serving passes `image_rows`
        instead: features already projected, for the given rows of the packed batch.
        """
        self._check_inputs(input_ids, kv_cache, position_ids, document_ids)
        self._maybe_compile(input_ids.device)
        context = self._context(context_split)
        rope = self._rope(input_ids, position_ids, ragged=kv_cache is not None)
        if self.stage.first:
            x = self.dropout(self._embed(input_ids, position_ids, images, image_rows))
        else:  # the previous stage's activations (under SP [b, s / T, h])
            x = hidden
        out = self._blocks_and_head(x, rope, labels, loss_mask, kv_cache, document_ids, context,
                                    output_index)
        if context is not None and labels is not None and self.stage.last:
            out = out * context_loss_scale(labels, loss_mask, context)  # the sequence's mean
        return out

    def _context(self, context_split: bool) -> ContextParallel | None:
        """The context group when the inputs are this rank's share of the sequence
        (trireme.parallel.context_parallel.split_batch)."""
        if context_split and self.ctx.context is None:
            raise TriremeError("context_split inputs need parallel.context > 1")
        return self.ctx.context if context_split else None

    def _check_inputs(self, input_ids, kv_cache, position_ids, document_ids) -> None:
        end = input_ids.shape[1]
        if self.cfg.position_embedding == "learned" and end > self.cfg.seq_length and (
                kv_cache is None):
            raise TriremeError(
                f"positions up to {end} exceed model.seq_length = {self.cfg.seq_length} "
                "(learned position embeddings have no rows past it)"
            )
        if kv_cache is not None and self.tp is not None and self.tp.sequence_parallel:
            raise TriremeError(
                "a KV cache under sequence parallelism: a decode step's one token per sequence "
                "cannot be split along the sequence; build the model without it "
                "(parallel.sequence_parallel = false), or pass use_cache=False"
            )
        if kv_cache is not None and (position_ids is None or document_ids is not None):
            raise TriremeError("a KV cache (PagedCache) takes the tokens' position_ids, and no "
                               "document_ids (those are for training)")

    def _rope(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
              ragged: bool = False) -> Rope | None:
        """cos, sin for the positions of `input_ids` (None with learned positions). `ragged`
        (serving): looked up in the whole table, with no host sync for the largest position."""
        if self.rope is None:
            return None
        if ragged and position_ids is not None:
            cos, sin = self.rope(input_ids.device, length=self.cfg.seq_length)  # [seq, d]
            return cos[position_ids], sin[position_ids]  # [b, s, d]
        if position_ids is not None:
            return self.rope(input_ids.device, position_ids=position_ids)  # 2 x [b, s, d]
        return self.rope(input_ids.device, length=input_ids.shape[1])  # [s, d]

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """[b_img, n, h]: the projected features of normalized images [b_img, 3, H, W]."""
        if not hasattr(self, "vision"):
            raise TriremeError("images were given to a model without a vision encoder "
                               "(model.vision_layers = 0)")
        return self.projector(self.vision(images))

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None,
               images: torch.Tensor | None = None, image_rows: ImageRows | None = None
               ) -> torch.Tensor:
        """[b, s, h] token (+ learned position) embeddings; under SP this rank's [b, s / T, h].
        Images: their features in place of the placeholder tokens' embeddings."""
        x = self.embedding(input_ids)
        if image_rows is not None:
            x = image_rows.merge(x)
        if images is not None:
            x = merge_images(x, input_ids, self.image_features(images), self.cfg.image_token_id)
        if self.cfg.position_embedding != "learned":
            return x
        if position_ids is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)  # [s]
            seq_dim = 0
        else:
            positions, seq_dim = position_ids, 1  # [b, s]
        if self.tp is not None:
            positions = self.tp.sequence_shard(positions, dim=seq_dim)  # [s / T] under SP
        return x + self.position_embedding(positions)  # [b, s, h] + [s, h] (or [b, s, h])

    def _blocks_and_head(
        self,
        x: torch.Tensor,
        rope: Rope | None,
        labels: torch.Tensor | None,
        loss_mask: torch.Tensor | None,
        kv_cache: PagedCache | None,
        document_ids: torch.Tensor | None = None,
        context: ContextParallel | None = None,
        output_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        for name, block in self.layers.items():
            if kv_cache is None:
                x = block(x, rope, document_ids=document_ids, context=context)
            else:  # decoding: the cache picks how (trireme.models.paged)
                x = kv_cache.forward_layer(block, x, rope, int(name))
        if not self.stage.last:
            return x  # [b, s, h]: the next stage's input
        if output_index is not None:
            x = x.index_select(1, output_index)  # [b, n, h]: only the logits asked for
        x = self.final_norm(x)
        if self.tp is not None:  # vocabulary split over the ranks: no full logits for the loss
            return parallel_output(
                x, self.output_weight(), self.tp, self.cfg.vocab_size, labels, loss_mask
            )
        if labels is not None and self.cfg.fused_loss(x.is_cuda):  # no [b, s, vocab] logits
            if (self.liger_loss and x.is_cuda and torch.is_grad_enabled()
                    and liger_loss_applies(labels, loss_mask)):  # evaluation: trireme's, no grads
                weight = self.output_weight()[: self.cfg.vocab_size]  # [vocab, h]
                return liger_linear_cross_entropy(x, weight, labels, loss_mask)
            return fused_linear_cross_entropy(
                x, self.output_weight(), labels, loss_mask, vocab_size=self.cfg.vocab_size,
                chunk_size=self.cfg.loss_chunk_size, compile=self.cfg.compile and x.is_cuda,
                fp8=self._fp8_output(), softmax_kernel=self.cfg.fused_cross_entropy_kernel,
                fp8_softmax_kernel=self.cfg.fp8_cross_entropy_kernel,
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
    cfg: ModelConfig, pcfg: ParallelConfig, pipeline_rank: int,
    ctx: ParallelContext | None = None, seed: int | None = 0,
) -> list[GPT]:
    """This pipeline rank's model chunks (GPTs holding one stage each), initialized by name."""
    return [GPT(cfg, seed=seed, ctx=ctx, stage=spec)
            for spec in rank_stages(cfg, pcfg, pipeline_rank)]
