"""Hugging Face `LlavaForConditionalGeneration` (CLIP vision tower + Llama) <-> trireme.

The vision GPT of trireme.models.vision on one side, transformers' LLaVA on the other.

The language model is the Llama table of convert_hf.py; this file adds the image side and the
names around it. Checkpoints name the parts in two ways (the published llava-hf folders and what
transformers 5 writes: `language_model.model.*`, `language_model.lm_head.*`,
`vision_tower.[vision_model.]*`, `multi_modal_projector.*`; transformers' in-memory names put
`model.` before the first three). Reading maps all of them to one canonical form
(`model.*` / `lm_head.weight` for the Llama table, `vision_tower.*`, `multi_modal_projector.*`);
writing uses the form transformers 5 itself saves.

Semantics that must agree (transformers' LlavaModel.get_image_features):
- `vision_feature_layer` indexes CLIP's hidden_states: 0 the embeddings after pre_layrnorm, k the
  output of encoder layer k, negative from the end. trireme builds only the blocks up to it
  (model.vision_feature_layer keeps the same meaning); the later layers and post_layernorm never
  change the features and are left out on reading. Writing gives the blocks trireme has, with
  vision_feature_layer = -1 and an identity post_layernorm.
- `vision_feature_select_strategy` "default" drops the class token's feature (model.
  vision_feature_select = "patch"), "full" keeps it.
- the projector is linear_1, GeLU (exact), linear_2, with biases; `image_token_index` is the
  placeholder id (model.image_token_id).
CLIP's patch embedding is a stride-p conv [w, 3, p, p]; trireme's is the same weight as a linear
[w, 3 p p] over patches flattened (channel, row, column) (kind "patch" in hf_table.py).
"""

from __future__ import annotations

import re

from trireme.config import ModelConfig
from trireme.convert.hf_table import Entry
from trireme.errors import CheckpointError
from trireme.models.vision import feature_blocks

ACTIVATIONS = {"quick_gelu": "quick_gelu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}
THEIR_ACTIVATION = {ours: theirs for theirs, ours in ACTIVATIONS.items()}
# (pattern, canonical replacement), tried in order on every tensor name read
_READ_NAMES = [
    (re.compile(r"^(model\.)?language_model\.model\."), "model."),
    (re.compile(r"^(model\.)?language_model\.lm_head\."), "lm_head."),
    (re.compile(r"^model\.language_model\."), "model."),
    (re.compile(r"^(model\.)?vision_tower\.(vision_model\.)?"), "vision_tower."),
    (re.compile(r"^model\.multi_modal_projector\."), "multi_modal_projector."),
]


def canonical_names(tensors: dict) -> dict:
    """The tensors under canonical names (module docstring)."""
    out = {}
    for name, t in tensors.items():
        for pattern, replacement in _READ_NAMES:
            if pattern.match(name):
                name = pattern.sub(replacement, name, count=1)
                break
        out[name] = t
    return out


def written_name(name: str) -> str:
    """A canonical name as transformers 5 saves it."""
    if name.startswith(("model.", "lm_head.")):
        return "language_model." + name
    return name


def vision_fields(hf: dict, cfg: ModelConfig) -> list[str]:
    """Set cfg's vision fields from a llava config.json; returns notes. One-line errors for what
    trireme cannot hold."""
    v = hf.get("vision_config") or {}
    if v.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise CheckpointError(f"config.json: vision tower {v.get('model_type')!r} is not "
                              "supported (only clip_vision_model)")
    if v.get("hidden_act", "quick_gelu") not in ACTIVATIONS:
        raise CheckpointError(f"config.json: vision hidden_act {v['hidden_act']!r} is not "
                              f"supported ({', '.join(ACTIVATIONS)})")
    if float(v.get("layer_norm_eps", 1e-5)) != 1e-5:
        raise CheckpointError("config.json: vision layer_norm_eps must be 1e-5 (CLIP's)")
    layer = hf.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise CheckpointError(f"config.json: vision_feature_layer {layer!r} (several layers) "
                              "is not supported; one layer index only")
    select = hf.get("vision_feature_select_strategy", "default")
    if select not in ("default", "full"):
        raise CheckpointError(f"config.json: vision_feature_select_strategy {select!r} is not "
                              "supported (default or full)")
    if hf.get("projector_hidden_act", "gelu") != "gelu" or \
            not hf.get("multimodal_projector_bias", True):
        raise CheckpointError("config.json: only the gelu projector with biases is supported")
    cfg.vision_layers = v.get("num_hidden_layers", 24)
    cfg.vision_hidden_size = v.get("hidden_size", 1024)
    cfg.vision_ffn_hidden_size = v.get("intermediate_size", 4096)
    cfg.vision_attention_heads = v.get("num_attention_heads", 16)
    cfg.vision_image_size = v.get("image_size", 224)
    cfg.vision_patch_size = v.get("patch_size", 32)
    cfg.vision_activation = ACTIVATIONS[v.get("hidden_act", "quick_gelu")]
    cfg.vision_class_token = cfg.vision_pre_norm = True
    cfg.vision_feature_layer = layer
    cfg.vision_feature_select = "patch" if select == "default" else "full"
    cfg.image_token_id = hf.get("image_token_index", hf.get("image_token_id", 32000))
    return []


def vision_entries(cfg: ModelConfig) -> list[Entry]:
    """The vision tower's and the projector's tensors (canonical names)."""
    e, w = "vision_tower.embeddings.", cfg.vision_hidden_size
    table = [Entry("vision.patch_embedding.weight", (e + "patch_embedding.weight",), "patch"),
             Entry("vision.class_embedding", (e + "class_embedding",)),
             Entry("vision.position_embedding.weight", (e + "position_embedding.weight",)),
             Entry("vision.pre_norm.weight", ("vision_tower.pre_layrnorm.weight",)),
             Entry("vision.pre_norm.bias", ("vision_tower.pre_layrnorm.bias",))]
    pairs = {"attention_norm": "layer_norm1", "attention.out": "self_attn.out_proj",
             "mlp_norm": "layer_norm2", "mlp.fc1": "mlp.fc1", "mlp.fc2": "mlp.fc2"}
    for i in range(feature_blocks(cfg)):
        ours, theirs = f"vision.layers.{i}.", f"vision_tower.encoder.layers.{i}."
        for part in ("weight", "bias"):
            table.append(Entry(f"{ours}attention.qkv.{part}",
                               tuple(f"{theirs}self_attn.{x}_proj.{part}" for x in "qkv"), "cat",
                               (w, w, w)))
            table += [Entry(f"{ours}{a}.{part}", (f"{theirs}{b}.{part}",))
                      for a, b in pairs.items()]
    for ours, theirs in (("fc1", "linear_1"), ("fc2", "linear_2")):
        table += [Entry(f"projector.{ours}.{part}", (f"multi_modal_projector.{theirs}.{part}",))
                  for part in ("weight", "bias")]
    return table


def ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors of a llava folder that never change the logits: the vision layers after the
    feature layer, CLIP's post_layernorm."""
    if name.startswith("vision_tower.post_layernorm."):
        return True
    found = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
    return bool(found) and int(found.group(1)) >= feature_blocks(cfg)


def llava_config(cfg: ModelConfig, text_config: dict) -> dict:
    """config.json of a LlavaForConditionalGeneration holding this model (module docstring)."""
    if not (cfg.vision_class_token and cfg.vision_pre_norm):
        raise CheckpointError("a CLIP vision tower has a class token and a pre-norm; this vision "
                              "encoder (vision_class_token / vision_pre_norm off) cannot be "
                              "exported to Hugging Face")
    blocks = feature_blocks(cfg)
    vision = {"model_type": "clip_vision_model", "hidden_size": cfg.vision_hidden_size,
              "intermediate_size": cfg.vision_ffn_hidden_size or 4 * cfg.vision_hidden_size,
              "num_hidden_layers": blocks, "num_attention_heads": cfg.vision_attention_heads,
              "image_size": cfg.vision_image_size, "patch_size": cfg.vision_patch_size,
              "hidden_act": THEIR_ACTIVATION[cfg.vision_activation], "layer_norm_eps": 1e-5,
              "num_channels": 3}
    select = "default" if cfg.vision_feature_select == "patch" else "full"
    patches = (cfg.vision_image_size // cfg.vision_patch_size) ** 2
    return {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
            "text_config": text_config, "vision_config": vision,
            "image_token_index": cfg.image_token_id, "vision_feature_layer": -1,
            "vision_feature_select_strategy": select, "projector_hidden_act": "gelu",
            "multimodal_projector_bias": True, "image_seq_length": patches,
            "tie_word_embeddings": cfg.tie_embeddings,
            "torch_dtype": text_config.get("torch_dtype", "float32")}
