"""The image side of a LLaVA-style model: a ViT encoder (CLIP / SigLIP shapes) and the projector.

    patches = patchify(image)                           [b, n, 3 p p]    n = (image / p)^2
    x = patches W_patch^T                               [b, n, w]        (a stride-p conv)
    x = [class; x] + positions                          [b, n (+1), w]   (class token optional)
    x = pre_norm(x)                                     hidden state 0   (CLIP's pre-LayerNorm)
    for k in 1..K:  x = x + attention(norm(x));  x = x + mlp(norm(x))      hidden state k
    features = x, without the class token ("patch") or with it ("full")

K is model.vision_feature_layer read as Hugging Face's `hidden_states` index (0: the embeddings,
-1: the last of vision_layers blocks, -2 LLaVA's choice), so only the blocks up to it are built:
the ones after it never change the features. The blocks are trireme's own attention (non-causal,
`VisionAttention`) and MLP (`VisionMLP`, with CLIP's quick-GeLU or GeLU), so tensor parallelism
splits them like the language model's; LayerNorm with biases everywhere, as CLIP and SigLIP have.

The projector maps each feature to the language model's width, fc2(gelu(fc1(f))) (GeLU exact, as
LLaVA-1.5's `mlp2x_gelu`); the GPT puts its outputs where the text has image placeholder tokens
(trireme.models.gpt). Under tensor parallelism fc1 is column- and fc2 row-parallel; the encoder and
projector always see whole sequences (no sequence parallelism: the patch count need not divide T).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from trireme.config import ModelConfig
from trireme.errors import ConfigError
from trireme.models.attention import Attention
from trireme.models.init import InitRule
from trireme.models.mlp import MLP
from trireme.parallel.context import ParallelContext
from trireme.parallel.tensor import column_linear, row_linear

NORM_EPS = 1e-5  # CLIP's LayerNorm epsilon


def feature_blocks(cfg: ModelConfig) -> int:
    """K: the number of vision blocks whose output feeds the projector (module docstring)."""
    k = cfg.vision_feature_layer
    return k if k >= 0 else cfg.vision_layers + 1 + k


def num_image_tokens(cfg: ModelConfig) -> int:
    """Placeholder tokens one image takes in the text: its patches (+ the class token, "full")."""
    patches = (cfg.vision_image_size // cfg.vision_patch_size) ** 2
    return patches + int(cfg.vision_class_token and cfg.vision_feature_select == "full")


def check_vision(cfg: ModelConfig, tensor: int = 1) -> None:
    """One-line ConfigErrors for vision settings that do not fit together."""
    if cfg.vision_image_size % cfg.vision_patch_size or cfg.vision_patch_size < 1:
        raise ConfigError(f"model.vision_image_size = {cfg.vision_image_size} is not a multiple "
                          f"of model.vision_patch_size = {cfg.vision_patch_size}")
    if not 0 <= feature_blocks(cfg) <= cfg.vision_layers:
        raise ConfigError(f"model.vision_feature_layer = {cfg.vision_feature_layer} is outside "
                          f"-{cfg.vision_layers + 1}..{cfg.vision_layers} (vision_layers blocks)")
    heads = cfg.vision_attention_heads
    if cfg.vision_hidden_size % heads or heads % tensor:
        raise ConfigError(f"model.vision_attention_heads = {heads} must divide "
                          f"model.vision_hidden_size = {cfg.vision_hidden_size} and be divisible "
                          f"by parallel.tensor = {tensor}")
    if num_image_tokens(cfg) >= cfg.seq_length:
        raise ConfigError(f"an image takes {num_image_tokens(cfg)} tokens, more than "
                          f"model.seq_length = {cfg.seq_length}; raise seq_length")


def check_vision_layout(cfg: ModelConfig, tensor: int, context: int,
                        sequence_parallel: bool) -> None:
    """What a vision model's parallel layout needs, checked before any process group exists (so
    the trainer and the planner refuse the same layouts): check_vision at this tensor degree, and
    no context or sequence parallelism yet (one-line ConfigErrors)."""
    check_vision(cfg, tensor)
    if context > 1 or (sequence_parallel and tensor > 1):
        raise ConfigError("model.vision_layers > 0 does not support parallel.context > 1 or "
                          "parallel.sequence_parallel yet; turn them off")


def encoder_config(cfg: ModelConfig) -> ModelConfig:
    """The ModelConfig the vision blocks are built from: the vision_* shape, LayerNorm, biases."""
    return dataclasses.replace(
        cfg, num_layers=max(feature_blocks(cfg), 1), hidden_size=cfg.vision_hidden_size,
        num_attention_heads=cfg.vision_attention_heads, num_query_groups=0, head_dim=0,
        ffn_hidden_size=cfg.vision_ffn_hidden_size, layer_pattern="", normalization="layernorm",
        norm_eps=NORM_EPS, activation="gelu", fused_swiglu=False, qk_norm=False, bias=True,
        dropout=0.0, vision_layers=0, freeze=[])


def whole_sequence_context(ctx: ParallelContext) -> ParallelContext:
    """`ctx` with sequence parallelism off: the encoder's layers see whole patch sequences."""
    tensor = ctx.tensor
    if tensor is not None and tensor.sequence_parallel:
        tensor = dataclasses.replace(tensor, sequence_parallel=False)
    return ParallelContext(ctx.mesh, tensor, None)


class VisionAttention(Attention):
    """Self-attention over all patches in both directions (no causal mask, no RoPE)."""

    causal = False

    def init_rules(self) -> dict[str, InitRule]:
        """Plain Normal(0, init_std) for the output too: no scaling by the LM's depth."""
        return {"qkv.weight": InitRule(parts=self.qkv_parts)}


class VisionMLP(MLP):
    """The two-matrix MLP with the vision activation (model.vision_activation)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__(cfg, ctx)
        self.kind = cfg.vision_activation

    def init_rules(self) -> dict[str, InitRule]:
        return {}  # plain Normal(0, init_std), no scaling by the LM's depth

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "quick_gelu":
            return h * torch.sigmoid(1.702 * h)
        return F.gelu(h, approximate="tanh" if self.kind == "gelu_tanh" else "none")


class VisionBlock(nn.Module):
    """x = x + attention(attention_norm(x)); x = x + mlp(mlp_norm(x))   [b, n, w]."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        w = cfg.hidden_size
        self.attention_norm = nn.LayerNorm(w, eps=NORM_EPS)
        self.attention = VisionAttention(cfg, ctx)
        self.mlp_norm = nn.LayerNorm(w, eps=NORM_EPS)
        self.mlp = VisionMLP(cfg, ctx)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


def patchify(images: torch.Tensor, p: int) -> torch.Tensor:
    """[b, c, H, W] -> [b, (H / p) (W / p), c p p]: patches in row-major order, each flattened
    (channel, row, column), the order of a conv weight [w, c, p, p] reshaped to [w, c p p]."""
    b, c, height, width = images.shape
    x = images.reshape(b, c, height // p, p, width // p, p)  # [b, c, H/p, p, W/p, p]
    x = x.permute(0, 2, 4, 1, 3, 5)  # [b, H/p, W/p, c, p, p]
    return x.reshape(b, (height // p) * (width // p), c * p * p)


class VisionEncoder(nn.Module):
    """The ViT (module docstring): images [b, 3, H, W] -> features [b, n, w]; the pixels are
    normalized by the data pipeline (trireme.data.images.pixels, CLIP's mean and std)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        check_vision(cfg, ctx.size("tensor"))
        vcfg, ctx = encoder_config(cfg), whole_sequence_context(ctx)
        w, p = cfg.vision_hidden_size, cfg.vision_patch_size
        self.patch_size, self.select = p, cfg.vision_feature_select
        self.patch_embedding = nn.Linear(3 * p * p, w, bias=False)
        patches = (cfg.vision_image_size // p) ** 2
        if cfg.vision_class_token:
            self.class_embedding = nn.Parameter(torch.empty(w))
        self.position_embedding = nn.Embedding(patches + int(cfg.vision_class_token), w)
        if cfg.vision_pre_norm:
            self.pre_norm = nn.LayerNorm(w, eps=NORM_EPS)
        self.layers = nn.ModuleDict({str(i): VisionBlock(vcfg, ctx)
                                     for i in range(feature_blocks(cfg))})

    def init_rules(self) -> dict[str, InitRule]:
        return {}  # every weight a plain Normal(0, init_std)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embedding(patchify(images.to(self.patch_embedding.weight.dtype),
                                          self.patch_size))  # [b, n, w]
        if hasattr(self, "class_embedding"):
            cls = self.class_embedding.expand(x.shape[0], 1, -1)  # [b, 1, w]
            x = torch.cat([cls, x], dim=1)  # [b, n + 1, w]
        x = x + self.position_embedding.weight  # [b, n (+1), w] + [n (+1), w]
        if hasattr(self, "pre_norm"):
            x = self.pre_norm(x)
        for block in self.layers.values():
            x = block(x)
        if hasattr(self, "class_embedding") and self.select == "patch":
            x = x[:, 1:]  # [b, n, w]: the class token's feature dropped
        return x


class Projector(nn.Module):
    """Vision features [b, n, w] -> [b, n, h]: fc2(gelu(fc1(f))) (module docstring)."""

    def __init__(self, cfg: ModelConfig, ctx: ParallelContext) -> None:
        super().__init__()
        tp = whole_sequence_context(ctx).tensor
        h = cfg.hidden_size
        self.fc1 = column_linear(cfg.vision_hidden_size, [(h, 1)], True, tp)
        self.fc2 = row_linear(h, h, True, tp)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(features)))


def merge_images(embeddings: torch.Tensor, input_ids: torch.Tensor, image_embeddings: torch.Tensor,
                 image_token_id: int) -> torch.Tensor:
    """The text embeddings [b, s, h] with the image placeholder positions (input_ids ==
    image_token_id, in order) taking the rows of image_embeddings [b_img, n, h] in order."""
    is_image = (input_ids == image_token_id).unsqueeze(-1)  # [b, s, 1]
    return embeddings.masked_scatter(is_image, image_embeddings.to(embeddings.dtype))


@dataclass
class ImageRows:
    """Projected image features for chosen token rows of a packed batch (the serving engine:
    a prompt chunk holds some of a request's placeholder positions, and gets their features)."""

    index: torch.Tensor  # [m] long: rows along dim 1 of input_ids [1, T]
    features: torch.Tensor  # [m, h]: the features of those rows, in the same order

    def merge(self, embeddings: torch.Tensor) -> torch.Tensor:
        """embeddings [1, T, h] with rows `index` replaced by `features`."""
        return embeddings.index_copy(1, self.index, self.features[None].to(embeddings.dtype))


def freeze_parameters(model: nn.Module, patterns: list[str]) -> list[str]:
    """Set requires_grad = False on the parameters whose names match a glob of `patterns`
    (model.freeze); returns their names. The optimizer, the data-parallel buckets and the
    gradient sums leave them out (they ask requires_grad)."""
    frozen = []
    for name, param in model.named_parameters():
        if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns):
            param.requires_grad_(False)
            frozen.append(name)
    return frozen


def check_freeze_patterns(names: list[str], patterns: list[str], tied: bool = False) -> None:
    """One-line ConfigError for a model.freeze pattern that matches no parameter of the model,
    or patterns that leave nothing to train. `tied`: the output layer is the embedding's weight
    (model.tie_embeddings), so an `output.*` pattern is named as that."""
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            if tied and fnmatch.fnmatchcase("output.weight", pattern):
                raise ConfigError(f"model.freeze pattern {pattern!r} matches no parameter: with "
                                  "model.tie_embeddings = true the output layer is "
                                  "embedding.weight; drop the pattern ('embedding.*' freezes both)")
            raise ConfigError(f"model.freeze pattern {pattern!r} matches no parameter; names look "
                              f"like {names[0]!r} (see `trireme inspect` or docs/multimodal.md)")
    if all(any(fnmatch.fnmatchcase(name, p) for p in patterns) for name in names):
        raise ConfigError(f"model.freeze = {patterns} freezes every parameter: nothing would "
                          "train; name only the parts to keep fixed (e.g. [\"vision.*\"])")
