"""Hugging Face folders (config.json + safetensors) to and from trireme's model.

Families: Llama-style decoders (model_type llama, mistral, qwen2, qwen3: RoPE, RMSNorm, SwiGLU, GQA,
optional q/k/v biases or QK-norm), their mixture-of-experts kin (mixtral, qwen3_moe: hf_moe.py),
GPT-2 (learned positions, LayerNorm, tanh GeLU, biases), Mamba-2 and the Nemotron-H hybrids
(mamba2, nemotron_h: hf_mamba.py).

One table per family lists, for each trireme tensor, the Hugging Face tensors it is made of and how
(hf_table.py). Reading runs the table forwards, writing backwards, so the two directions cannot
drift apart. Both sides use the "rotate half" RoPE pairing, so q and k need no permutation.

Biases map onto two switches: `qkv_bias` (the q/k/v projections alone: Qwen2) and `bias` (every
linear). A bias that Hugging Face's architecture lacks but `bias` implies (Llama's attention_bias
without mlp_bias) is filled with zeros on the way in, which changes nothing; on the way out the
architecture is picked so that no non-zero tensor is dropped.

What trireme does not model is either refused or, where the converted model is still exact within
limits, said in a note: a sliding attention window caps the context (model.seq_length) at the
window. The context the source supports is kept in model.max_position_embeddings, which the export
writes back however long the model was fine-tuned at.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor

from trireme.checkpoint import directory
from trireme.checkpoint.files import atomic_output_dir, copy_tokenizer_files
from trireme.checkpoint.model_state import expected_shapes, listing
from trireme.config import ModelConfig
from trireme.convert.converted import Converted, cast_state
from trireme.convert.hf_llava import (
    canonical_names,
    ignorable,
    llava_config,
    vision_entries,
    vision_fields,
    written_name,
)
from trireme.convert.hf_mamba import (
    MAMBA_TYPES,
    mamba2_entries,
    mamba2_hf_config,
    mamba2_model_config,
    mamba_family,
    nemotron_h_entries,
    nemotron_h_hf_config,
    nemotron_h_model_config,
    nemotron_h_with_head,
)
from trireme.convert.hf_moe import (
    ARCHITECTURES,
    MOE_TYPES,
    choose_moe_architecture,
    moe_entries,
    moe_fields,
    moe_hf_config,
)
from trireme.convert.hf_table import (
    Entry,
    export_state,
    sublayer_entries,
    their_shapes,
    to_ours,
    weight_dtype,
    with_biases,
)
from trireme.data.chat import generation_eos_ids
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import CheckpointError, TriremeError

LLAMA_TYPES = ("llama", "mistral", "qwen2", "qwen3", *MOE_TYPES)
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SHARD_BYTES = 5 * 2**30  # the size Hugging Face shards at by default
# Buffers some Hugging Face checkpoints carry that are not weights.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


# --------------------------------------------------------------------------------------------
# Tables


def _llama_table(cfg: ModelConfig, qkv_bias: bool, out_bias: bool, mlp_bias: bool,
                 kind: str = "llama") -> list[Entry]:
    """The table of a Llama-style model; `kind` names the MoE family of its `E` sublayers."""
    table = [Entry("embedding.weight", ("model.embed_tokens.weight",), "vocab")]
    for i, layer in enumerate(cfg.layer_kinds):  # each attention, then an MLP or MoE
        for sublayer in layer:
            table += LLAMA_ENTRIES[sublayer](cfg, i, kind, (qkv_bias, out_bias, mlp_bias))
    table.append(Entry("final_norm.weight", ("model.norm.weight",)))
    if not cfg.tie_embeddings:
        table.append(Entry("output.weight", ("lm_head.weight",), "vocab"))
    return table


def _attention_entries(cfg: ModelConfig, i: int, kind: str, biases: Biases) -> list[Entry]:
    rows = sublayer_entries(cfg, "attention", f"layers.{i}.attention.",
                            f"model.layers.{i}.self_attn.")
    qkv, out = rows[:2]
    norm = Entry(f"layers.{i}.attention_norm.weight", (f"model.layers.{i}.input_layernorm.weight",))
    return [norm, *rows, *with_biases([qkv] if biases[0] else []),
            *with_biases([out] if biases[1] else [])]


def _mlp_entries(cfg: ModelConfig, i: int, kind: str, biases: Biases) -> list[Entry]:
    rows = sublayer_entries(cfg, "mlp", f"layers.{i}.mlp.", f"model.layers.{i}.mlp.")
    norm = Entry(f"layers.{i}.mlp_norm.weight",
                 (f"model.layers.{i}.post_attention_layernorm.weight",))
    return [norm, *rows, *with_biases(rows if biases[2] else [])]


def _gpt2_table(cfg: ModelConfig) -> list[Entry]:
    table = [Entry("embedding.weight", ("transformer.wte.weight",), "vocab"),
             Entry("position_embedding.weight", ("transformer.wpe.weight",))]
    pairs = {"attention_norm": ("ln_1", "copy"), "attention.qkv": ("attn.c_attn", "conv1d"),
             "attention.out": ("attn.c_proj", "conv1d"), "mlp_norm": ("ln_2", "copy"),
             "mlp.fc1": ("mlp.c_fc", "conv1d"), "mlp.fc2": ("mlp.c_proj", "conv1d")}
    for i in range(cfg.num_layers):
        for ours, (theirs, kind) in pairs.items():
            hf = f"transformer.h.{i}.{theirs}"
            table += [Entry(f"layers.{i}.{ours}.weight", (hf + ".weight",), kind),
                      Entry(f"layers.{i}.{ours}.bias", (hf + ".bias",))]
    table += [Entry("final_norm.weight", ("transformer.ln_f.weight",)),
              Entry("final_norm.bias", ("transformer.ln_f.bias",))]
    if not cfg.tie_embeddings:
        table.append(Entry("output.weight", ("lm_head.weight",), "vocab"))
    return table


# --------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


Biases = tuple[bool, bool, bool]  # q/k/v, output projection, MLP
# kind -> the table rows of layer i's sublayer of that kind (its norm included) in the Llama
# family: (cfg, i, the MoE family, biases) -> rows
LLAMA_ENTRIES = {"attention": _attention_entries, "mlp": _mlp_entries, "moe": moe_entries}
QWEN_MAX_WINDOW_LAYERS = 28  # transformers' default max_window_layers (Qwen2, Qwen3)


def _rope_settings(hf: dict, kind: str) -> tuple[float, dict]:
    """RoPE's theta and scaling as transformers 5 reads config.json: a legacy rope_scaling that is
    not null replaces rope_parameters whole (theta then from rope_theta beside it, or the
    family's default)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    default_theta = 1e6 if kind == "mixtral" else 10000.0
    return float(rope.get("rope_theta", hf.get("rope_theta", default_theta))), rope


def _sliding_layers(hf: dict, kind: str) -> tuple[int, list[int]]:
    """The attention window and the layers that use it, as transformers reads config.json:
    Mistral and Mixtral slide in every layer when sliding_window is set; the Qwen families only
    with use_sliding_window, Qwen2 / Qwen3 in the layers layer_types names sliding_attention
    (without layer_types: from max_window_layers on). (0, []) when no layer slides."""
    window, n = hf.get("sliding_window") or 0, hf["num_hidden_layers"]
    if not window or kind == "llama":
        return 0, []
    if kind in ("mistral", "mixtral"):
        return window, list(range(n))
    if not hf.get("use_sliding_window"):
        return 0, []
    if kind not in ("qwen2", "qwen3"):
        return window, list(range(n))
    first = hf.get("max_window_layers", QWEN_MAX_WINDOW_LAYERS)
    types = hf.get("layer_types") or [
        "sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return window, [i for i, t in enumerate(types) if t == "sliding_attention"]


def _context(hf: dict, kind: str) -> tuple[int, list[str]]:
    """The context to convert at (max_position_embeddings) and its note: capped at a sliding
    attention window that is shorter, as trireme has none; within the window full attention
    computes the same."""
    context = hf.get("max_position_embeddings", 2048)
    window, sliding = _sliding_layers(hf, kind)
    if not sliding or window >= context:
        return context, []
    n = hf["num_hidden_layers"]
    where = "every layer" if len(sliding) == n else f"{len(sliding)} of {n} layers"
    return window, [f"sliding-window attention ({window} tokens, {where}) is not modelled: the "
                    f"context (model.seq_length, max_position_embeddings) is capped at {window} "
                    f"instead of {context}, where full attention computes the same"]


def _bias_switches(biases: Biases) -> dict[str, bool]:
    """model.bias (every linear) and model.qkv_bias (q/k/v alone: Qwen2) for Hugging Face's
    (q/k/v, output projection, MLP) biases."""
    qkv, out, mlp = biases
    return {"bias": out or mlp, "qkv_bias": qkv and not (out or mlp)}


def _llama_model_config(hf: dict, has_lm_head: bool) -> tuple[ModelConfig, Biases, list[str]]:
    kind = hf["model_type"]
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(
            f"config.json: hidden_act {hf['hidden_act']!r} is not supported (only silu)"
        )
    if hf.get("partial_rotary_factor", 1.0) != 1.0:
        raise CheckpointError("config.json: partial rotary embeddings are not supported")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or h // heads
    theta, scaling = _rope_settings(hf, kind)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise CheckpointError(
            f"config.json: rope scaling {rope_type!r} is not supported (none or llama3)"
        )
    context, notes = _context(hf, kind)
    attention_bias = bool(hf.get("attention_bias", False))
    biases = {  # (qkv, out, mlp)
        "llama": (attention_bias, attention_bias, bool(hf.get("mlp_bias", False))),
        "mistral": (False, False, False),
        "qwen2": (True, False, False),
        "qwen3": (attention_bias, attention_bias, False),
        "mixtral": (False, False, False),
        "qwen3_moe": (attention_bias, attention_bias, False),
    }[kind]
    cfg = ModelConfig(
        num_layers=hf["num_hidden_layers"], hidden_size=h, num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=0 if head_dim * heads == h else head_dim,
        ffn_hidden_size=hf["intermediate_size"], vocab_size=hf["vocab_size"],
        seq_length=context, max_position_embeddings=context, position_embedding="rope",
        rope_theta=theta, normalization="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), activation="swiglu",
        qk_norm=kind in ("qwen3", "qwen3_moe"), **_bias_switches(biases),
        tie_embeddings=bool(hf.get("tie_word_embeddings", not has_lm_head)),
        **(moe_fields(hf, kind) if kind in MOE_TYPES else {}),
    )
    if rope_type == "llama3":
        cfg.rope_scaling = "llama3"
        cfg.rope_scaling_factor = float(scaling["factor"])
        cfg.rope_low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        cfg.rope_high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        cfg.rope_original_max_position = int(scaling["original_max_position_embeddings"])
    return cfg, biases, notes


def _gpt2_model_config(hf: dict, has_lm_head: bool) -> tuple[ModelConfig, list[str]]:
    notes = []
    act = hf.get("activation_function", "gelu_new")
    if act == "gelu":
        notes.append("GPT-2 config asks for exact (erf) GeLU; trireme uses the tanh approximation, "
                     "so logits differ slightly")
    elif act not in ("gelu_new", "gelu_pytorch_tanh"):
        raise CheckpointError(f"config.json: activation_function {act!r} is not supported")
    if not hf.get("scale_attn_weights", True) or hf.get("scale_attn_by_inverse_layer_idx"):
        raise CheckpointError("config.json: GPT-2 attention scaling variants are not supported")
    h = hf["n_embd"]
    cfg = ModelConfig(
        num_layers=hf["n_layer"], hidden_size=h, num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf.get("n_inner") or 4 * h, vocab_size=hf["vocab_size"],
        seq_length=hf.get("n_positions", 1024), position_embedding="learned",
        normalization="layernorm", norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        activation="gelu", bias=True,
        tie_embeddings=bool(hf.get("tie_word_embeddings", not has_lm_head)),
    )
    return cfg, notes


def _hf_config(cfg: ModelConfig, kind: str, biases: Biases, dtype: torch.dtype) -> dict:
    common = {"vocab_size": cfg.vocab_size, "tie_word_embeddings": cfg.tie_embeddings,
              "torch_dtype": _DTYPE_NAMES[dtype], "bos_token_id": None, "eos_token_id": None}
    if kind in MAMBA_TYPES:
        family = mamba2_hf_config(cfg) if kind == "mamba2" else nemotron_h_hf_config(cfg)
        return {**common, **family}  # nemotron_h's tie_word_embeddings is always false
    if kind == "gpt2":
        return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_attention_heads, "n_inner": cfg.ffn_size,
                "n_positions": cfg.seq_length, "layer_norm_epsilon": cfg.norm_eps,
                "activation_function": "gelu_new", "resid_pdrop": cfg.dropout,
                "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout, **common}
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
            **ARCHITECTURES}
    out = {"architectures": [arch[kind]], "model_type": kind,
           "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
           "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_attention_heads,
           "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size, "hidden_act": "silu",
           "max_position_embeddings": exported_context(cfg), "rms_norm_eps": cfg.norm_eps,
           "rope_theta": cfg.rope_theta, "rope_scaling": None, "attention_dropout": cfg.dropout,
           **common}
    if kind == "llama":
        out.update(attention_bias=biases[0], mlp_bias=biases[2])
    if kind in ("qwen3", "qwen3_moe"):
        out["attention_bias"] = biases[0]
    if kind in MOE_TYPES:
        out.update(moe_hf_config(cfg, kind))
    if cfg.rope_scaling == "llama3":
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_position}
    return out


def exported_context(cfg: ModelConfig) -> int:
    """max_position_embeddings on export: the context the model supports (kept from the source
    in model.max_position_embeddings), or the length it was trained at if that is longer."""
    return max(cfg.max_position_embeddings, cfg.seq_length)


def _choose_architecture(cfg: ModelConfig, state: dict[str, Tensor]) -> tuple[str, Biases]:
    """The Hugging Face architecture (and its bias switches) that holds this model exactly."""
    shape = (cfg.position_embedding, cfg.normalization, cfg.activation)
    attention_bias = cfg.bias or cfg.qkv_bias  # Qwen3's covers q/k/v and o (o's zero if absent)
    if cfg.has_kind("mamba"):
        return mamba_family(cfg), (cfg.bias, cfg.bias, False)
    if shape == ("rope", "rmsnorm", "swiglu") and cfg.has_kind("moe"):
        return choose_moe_architecture(cfg), (attention_bias, attention_bias, False)
    other = sorted({layer for layer in cfg.layer_symbols if layer != "*-"})
    if other:  # the dense families' every layer is attention then one MLP
        raise CheckpointError(
            f"model.layer_pattern = {cfg.layer_pattern!r} has layers {', '.join(other)}: GPT-2 "
            "and the Llama family hold only attention + MLP layers (*-); this model cannot be "
            "exported to Hugging Face")
    if shape == ("learned", "layernorm", "gelu") and not cfg.qk_norm:
        heads = cfg.num_attention_heads
        if cfg.kv_heads != heads or cfg.head_size * heads != cfg.hidden_size:
            raise CheckpointError("GPT-2 has no grouped-query attention or separate head_dim; "
                                  "this model cannot be exported to Hugging Face")
        return "gpt2", (True, True, True)
    if shape != ("rope", "rmsnorm", "swiglu"):
        raise CheckpointError(
            f"no Hugging Face architecture matches position_embedding={shape[0]}, "
            f"normalization={shape[1]}, activation={shape[2]} (supported: GPT-2 = learned / "
            "layernorm / gelu, Llama family = rope / rmsnorm / swiglu)"
        )
    nonzero = lambda part: any(bool(t.any()) for n, t in state.items() if n.endswith(part))
    out_bias = nonzero("attention.out.bias")
    mlp_bias = nonzero("mlp.fc1.bias") or nonzero("mlp.fc2.bias")
    if cfg.qk_norm:
        if mlp_bias:
            raise CheckpointError("QK-norm with MLP biases has no Hugging Face architecture (Qwen3 "
                                  "has no MLP biases)")
        return "qwen3", (attention_bias, attention_bias, False)
    if cfg.qkv_bias and not cfg.bias:  # q/k/v biases alone
        return "qwen2", (True, False, False)
    if not cfg.bias:
        return "llama", (False, False, False)
    if not out_bias and not mlp_bias:
        return "qwen2", (True, False, False)
    return "llama", (True, True, mlp_bias)


# --------------------------------------------------------------------------------------------
# Reading


def read_json_file(path: Path) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path} is missing; a Hugging Face folder needs it")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable or corrupted ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return data


def safetensors_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the file holding it: the single file where there is one (as
    transformers loads it: save_pretrained over a sharded folder leaves the old index behind),
    else from the index (sharded)."""
    if (folder / SINGLE_FILE).is_file():
        return {"": folder / SINGLE_FILE}  # every name; listed when opened
    if (folder / INDEX_FILE).is_file():
        weight_map = read_json_file(folder / INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{folder / INDEX_FILE} has no weight_map")
        outside = [f for f in set(weight_map.values())
                   if not isinstance(f, str) or Path(f).is_absolute() or ".." in Path(f).parts]
        if outside:  # an index names files of its own folder, nothing elsewhere
            raise CheckpointError(f"{folder / INDEX_FILE} names {sorted(map(str, outside))[0]!r}, "
                                  "outside its folder")
        return {name: folder / file for name, file in weight_map.items()}
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise CheckpointError(
            f"{folder} holds pickled weights (.bin / .pt), which are never unpickled here; "
            "re-save them with transformers' save_pretrained (safetensors is its default)"
        )
    raise CheckpointError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def read_hf_tensors(folder: Path) -> dict[str, Tensor]:
    """Every tensor of a Hugging Face folder, on CPU; errors name the file."""
    by_file: dict[Path, list[str]] = {}
    for name, file in safetensors_files(folder).items():
        by_file.setdefault(file, []).append(name)
    tensors: dict[str, Tensor] = {}
    for file, names in by_file.items():
        if not file.is_file():
            raise CheckpointError(f"{file} is missing (listed in {INDEX_FILE})")
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                present = set(f.keys())
                wanted = sorted(present) if names == [""] else names
                lacking = [n for n in wanted if n not in present]
                if lacking:
                    raise CheckpointError(listing(f"{file} lacks tensors its index lists", lacking))
                tensors.update({n: f.get_tensor(n) for n in wanted})
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file} is truncated or corrupted ({e})") from None
    return tensors


def _with_prefix(tensors: dict[str, Tensor], prefix: str, probe: str) -> dict[str, Tensor]:
    """Add the base-model prefix ("model." / "transformer.") if the file was saved without it."""
    if prefix + probe in tensors or probe not in tensors:
        return tensors
    return {(n if n.startswith("lm_head.") else prefix + n): t for n, t in tensors.items()}


def distinct_head(tensors: dict[str, Tensor], table: list[Entry]) -> bool:
    """Whether the files hold an lm_head.weight that is not the input embedding's values."""
    head = tensors.get("lm_head.weight")
    embedding = next((tensors.get(e.theirs[0]) for e in table if e.ours == "embedding.weight"),
                     None)
    return head is not None and embedding is not None and not (
        head.shape == embedding.shape and torch.equal(head, embedding))


def untied(hf: dict) -> dict:
    """config.json with tie_word_embeddings false (also in a text_config)."""
    out = {**hf, "tie_word_embeddings": False}
    if isinstance(hf.get("text_config"), dict):
        out["text_config"] = {**hf["text_config"], "tie_word_embeddings": False}
    return out


def hf_model_config(hf: dict, has_lm_head: bool) -> tuple[ModelConfig, list[Entry], list[str]]:
    """The ModelConfig, tensor table and notes for a config.json (`has_lm_head`: the files hold
    lm_head.weight, which decides tying when config.json does not say)."""
    kind = hf.get("model_type")
    text_config = hf.get("text_config")  # (a Llama's is not read: it may be anything)
    quantized = hf.get("quantization_config") or (
        text_config.get("quantization_config") if isinstance(text_config, dict) else None)
    if quantized:  # packed integers or fp8 with scales: not the weights under their names
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise CheckpointError(f"config.json: quantized weights (quantization_config: {method}) "
                              "are not supported; convert the unquantized model")
    try:
        if kind == "llava":  # a Llama language model with a CLIP vision tower (hf_llava.py)
            text = hf.get("text_config") or {}
            if text.get("model_type", "llama") != "llama":
                raise CheckpointError(f"config.json: llava with a {text['model_type']!r} "
                                      "language model is not supported (llama only)")
            cfg, biases, notes = _llama_model_config({"model_type": "llama", **text},
                                                     has_lm_head)
            notes += vision_fields(hf, cfg)
            return cfg, _llama_table(cfg, *biases) + vision_entries(cfg), notes
        if kind == "gpt2":
            cfg, notes = _gpt2_model_config(hf, has_lm_head)
            return cfg, _gpt2_table(cfg), notes
        if kind in LLAMA_TYPES:
            cfg, biases, notes = _llama_model_config(hf, has_lm_head)
            return cfg, _llama_table(cfg, *biases, kind), notes
        if kind == "mamba2":
            cfg, notes = mamba2_model_config(hf, has_lm_head)
            return cfg, mamba2_entries(cfg), notes
        if kind == "nemotron_h":
            cfg, notes = nemotron_h_model_config(hf, has_lm_head)
            return cfg, nemotron_h_entries(cfg), notes
    except KeyError as e:
        raise CheckpointError(f"config.json lacks {e}, which a {kind} model needs") from None
    except (TypeError, ValueError, AttributeError) as e:  # a null, a string for a number, ...
        raise CheckpointError(f"config.json of a {kind} model holds a value of the wrong type "
                              f"({e})") from None
    if kind == "qwen2_moe":
        raise CheckpointError("config.json: model_type qwen2_moe is not supported: its shared "
                              "expert is scaled by a sigmoid gate (shared_expert_gate) that "
                              "trireme's MoE layer lacks")
    raise CheckpointError(
        f"config.json: model_type {kind!r} is not supported (supported: gpt2, "
        f"{', '.join(LLAMA_TYPES + MAMBA_TYPES)})"
    )


def check_numbers(cfg: ModelConfig) -> None:
    """A CheckpointError for a number config.json gave as something else (null, a string, a
    fraction for a count), which would otherwise fail deep in building the tensors."""
    for f in dataclasses.fields(cfg):
        value, default = getattr(cfg, f.name), f.default
        if isinstance(default, bool) or not isinstance(default, int | float):
            continue
        wanted = int if isinstance(default, int) else int | float
        if isinstance(value, bool) or not isinstance(value, wanted):
            raise CheckpointError(f"config.json gives model.{f.name} = {value!r}, not "
                                  f"{'an integer' if wanted is int else 'a number'}")


def _read_config(folder: Path) -> dict:
    """config.json; a file, a trireme or a Megatron checkpoint given instead is named as such."""
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is a file; give the Hugging Face folder that holds "
                              "config.json")
    trireme = (folder / directory.META_FILE).is_file() or bool(directory.step_dirs(folder))
    if trireme and not (folder / "config.json").is_file():
        raise CheckpointError(f"{folder / 'config.json'} is missing (a trireme checkpoint? use "
                              "--from trireme)")
    if directory.foreign_format(folder) == "megatron":
        raise CheckpointError(f"{folder} is a Megatron-LM checkpoint: use --from megatron")
    return read_json_file(folder / "config.json")


def read_hf(folder: Path) -> Converted:
    """A Hugging Face folder as a `Converted` model (shapes checked against config.json)."""
    hf = _read_config(folder)
    kind = hf.get("model_type")
    tensors = read_hf_tensors(folder)
    if kind == "llava":
        tensors = canonical_names(tensors)
    elif kind == "gpt2":
        tensors = _with_prefix(tensors, "transformer.", "wte.weight")
    elif kind in LLAMA_TYPES:
        tensors = _with_prefix(tensors, "model.", "embed_tokens.weight")
    elif kind in MAMBA_TYPES:
        tensors = _with_prefix(tensors, "backbone.", "embeddings.weight")
    cfg, table, notes = hf_model_config(hf, "lm_head.weight" in tensors)
    check_numbers(cfg)
    if cfg.tie_embeddings and distinct_head(tensors, table):  # transformers keeps it: so do we
        cfg, table, notes = hf_model_config(untied(hf), True)
        notes = [*notes, "config.json ties the embeddings, but lm_head.weight differs from the "
                 "input embedding: kept as an untied output layer, as transformers loads it"]
    elif (kind == "nemotron_h" and not cfg.tie_embeddings and "lm_head.weight" in tensors
          and not distinct_head(tensors, table)):
        cfg, table, notes = hf_model_config({**hf, "tie_word_embeddings": True}, True)
        notes = [*notes, "lm_head.weight equals the input embedding (how trireme writes a tied "
                 "model: NemotronHForCausalLM never ties): read back as tied embeddings"]
    expected = their_shapes(table, cfg)
    missing = [n for n in expected if n not in tensors]
    mismatched = [f"{n}: {tuple(tensors[n].shape)} vs {expected[n]}" for n in expected
                  if n in tensors and tuple(tensors[n].shape) != expected[n]]
    ignored = lambda n: (n.endswith(IGNORED_SUFFIXES) or (kind == "llava" and ignorable(n, cfg))
                         or (n == "lm_head.weight" and cfg.tie_embeddings))
    unexpected = [n for n in tensors if n not in expected and not ignored(n)]
    problems = [listing(label, items) for label, items in (
        ("missing", missing), ("unexpected", unexpected),
        ("shapes (file vs config.json)", mismatched)) if items]
    if problems:
        raise CheckpointError(f"{folder} does not match its config.json: " + "; ".join(problems))
    state = {}
    for entry in table:
        state[entry.ours] = to_ours(entry, [tensors[n] for n in entry.theirs], cfg)
    dtype = weight_dtype(state)
    for name, shape in expected_shapes(cfg).items():
        if name not in state:  # biases Hugging Face's architecture lacks: zeros change nothing
            state[name] = torch.zeros(shape, dtype=dtype)
    return Converted(model=cfg, state=state, source=f"hf {kind} {folder}", notes=notes,
                     tokenizer_dir=folder)


# --------------------------------------------------------------------------------------------
# Writing


def write_hf(
    conv: Converted, output: Path, dtype: torch.dtype, shard_bytes: int = SHARD_BYTES
) -> str:
    """Write `conv` as a Hugging Face folder that `from_pretrained` loads; returns the model_type.

    Above `shard_bytes` the weights are split into shards with a model.safetensors.index.json.
    """

    cfg = conv.model
    kind, biases = _choose_architecture(cfg, conv.state)
    if kind in MAMBA_TYPES:
        table = mamba2_entries(cfg) if kind == "mamba2" else nemotron_h_entries(cfg)
    else:
        table = _gpt2_table(cfg) if kind == "gpt2" else _llama_table(cfg, *biases, kind)
    if cfg.vision_layers:
        table, config = _llava_export(cfg, kind, biases, dtype, table)
        kind = "llava"
    tensors = export_state(table, conv.state, cfg)
    if kind == "nemotron_h":
        tensors = nemotron_h_with_head(tensors)
    if kind == "llava":  # names as transformers saves them; CLIP's unused post_layernorm
        tensors = {written_name(n): t for n, t in tensors.items()}
        w = cfg.vision_hidden_size
        tensors["vision_tower.post_layernorm.weight"] = torch.ones(w)
        tensors["vision_tower.post_layernorm.bias"] = torch.zeros(w)
    tensors = cast_state(tensors, dtype)
    shards = _shard(tensors, shard_bytes)
    with atomic_output_dir(output) as tmp:
        if len(shards) == 1:
            save_file(shards[0], str(tmp / SINGLE_FILE), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        if kind != "llava":
            config = _hf_config(cfg, kind, biases, dtype)
        config = {**config, **_special_tokens(conv.tokenizer_dir)}
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        copy_tokenizer_files(conv.tokenizer_dir, tmp)
    return kind


def _llava_export(cfg: ModelConfig, kind: str, biases: Biases, dtype: torch.dtype,
                  table: list[Entry]) -> tuple[list[Entry], dict]:
    """The llava table and config.json for a vision model whose language model is `kind`."""
    if kind != "llama":
        raise CheckpointError(f"a vision model exports as Hugging Face llava, whose language "
                              f"model must be llama (this one is {kind})")
    return table + vision_entries(cfg), llava_config(cfg, _hf_config(cfg, kind, biases, dtype))


def _special_tokens(tokenizer_dir: Path | None) -> dict:
    """eos_token_id from the tokenizer carried along (its generation_config.json's ids, e.g. Llama
    3's end of text and end of turn, else its end-of-text token), so that HF's generate stops
    there, and bos_token_id where a beginning token is named (_bos_token) and the
    tokenizer has it; {} without a readable tokenizer."""
    if tokenizer_dir is None or not (tokenizer_dir / "tokenizer.json").is_file():
        return {}
    try:
        tokenizer = load_tokenizer(str(tokenizer_dir / "tokenizer.json"))
    except TriremeError:
        return {}
    ends = generation_eos_ids([tokenizer_dir])  # e.g. Llama 3's end of text and of turn
    eos = list(ends) if len(ends) > 1 else ends[0] if ends else tokenizer.eod
    out = {"eos_token_id": eos} if ends or tokenizer.eod >= 0 else {}
    bos = _bos_token(tokenizer_dir)
    bos_id = tokenizer.token_id(bos) if bos else None
    return {**out, "bos_token_id": bos_id} if bos_id is not None else out


def _bos_token(tokenizer_dir: Path) -> str | None:
    """The beginning-of-sequence token: tokenizer_config.json's bos_token, else the special
    token that tokenizer.json's template puts first (Llama 3's <|begin_of_text|>)."""
    config = _json_or_empty(tokenizer_dir / "tokenizer_config.json")
    bos = config.get("bos_token")
    if isinstance(bos, dict):  # an AddedToken written out
        bos = bos.get("content")
    if isinstance(bos, str) and bos:
        return bos
    processor = _json_or_empty(tokenizer_dir / "tokenizer.json").get("post_processor") or {}
    for template in [processor, *(processor.get("processors") or [])]:
        first = ((template.get("single") or [{}])[0] if isinstance(template, dict) else {})
        special = first.get("SpecialToken") if isinstance(first, dict) else None
        if isinstance(special, dict) and isinstance(special.get("id"), str):
            return special["id"]
    return None


def _json_or_empty(path: Path) -> dict:
    """A JSON object file, or {} where it is absent or unreadable (optional metadata)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _shard(tensors: dict[str, Tensor], shard_bytes: int) -> list[dict[str, Tensor]]:
    shards: list[dict[str, Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards
