"""Hugging Face's Mamba-2 (`Mamba2ForCausalLM`, model_type mamba2) and Nemotron-H
(`NemotronHForCausalLM`, model_type nemotron_h), both ways.

Every layer is one Mamba-2 mixer after an RMSNorm, which is trireme's `M` sublayer
(trireme.models.mamba) with the pattern "M" * num_layers:

    backbone.embeddings.weight                -> embedding.weight
    backbone.layers.i.norm.weight             -> layers.i.mamba_norm.weight
    backbone.layers.i.mixer.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}
                                              -> layers.i.mamba.{the same names}
    backbone.norm_f.weight                    -> final_norm.weight
    lm_head.weight                            -> output.weight (Mamba-2: absent when tied)

The tensors have the same layout on both sides (in_proj rows [z; x; B; C; dt], the
convolution over [x; B; C], the gated norm per group of d_in / n_groups channels), so every entry
is a copy. transformers' `residual_in_fp32` keeps the residual stream in fp32 in a bf16 model,
which trireme does not: logits agree in fp32 and differ by bf16 rounding otherwise.

Nemotron-H's blocks are each one sublayer after its own RMSNorm, `layers_block_type` naming them:
linear_attention (a Mamba-2 mixer, the names above), full_attention (q/k/v/o_proj, no position
embedding: trireme's position_embedding = "none"), mlp (up_proj, down_proj with squared ReLU:
activation = "relu2"); trireme's pattern spells the same sequence (M, *, -), so HF block i is
sublayer i of the pattern, wherever it lands in trireme's layers. Its Mamba mixers clamp the step
size to time_step_limit, (0, inf) unless set, as Mamba-2's do (mamba_dt_limit_min / _max);
time_step_min / _max only draw dt_bias's init. NemotronHForCausalLM never ties its lm_head to the
embedding (its `_tied_weights_keys` is empty, whatever tie_word_embeddings says; Mamba2ForCausalLM
does tie), so a tied model is written with lm_head.weight a copy of the embedding and
tie_word_embeddings false, and such a file (the two tensors equal) reads back tied. The MoE
blocks (latent projections, a shared expert, a corrected sigmoid router) and the
multi-token-prediction layers have no trireme counterpart.
"""

from __future__ import annotations

from torch import Tensor

from trireme.config import KINDS, MIXERS, ModelConfig
from trireme.convert.hf_table import Entry, sublayer_entries
from trireme.errors import CheckpointError
from trireme.models.block import sublayer_names

MAMBA_TYPES = ("mamba2", "nemotron_h")
# Nemotron-H's layers_block_type -> the sublayer kind of that block
BLOCK_KINDS = {"linear_attention": "mamba", "full_attention": "attention", "mlp": "mlp",
               "moe": "moe"}
SYMBOL_OF = {kind: symbol for symbol, kind in KINDS.items()}
DEFAULT_SEQ_LENGTH = 4096  # Mamba-2 has no positional limit; trireme's generation stops here


def mamba2_entries(cfg: ModelConfig) -> list[Entry]:
    """The table of a Mamba2ForCausalLM model."""
    table = [Entry("embedding.weight", ("backbone.embeddings.weight",), "vocab")]
    biases = ("in_proj.bias", "out_proj.bias") if cfg.bias else ()
    for i in range(cfg.num_layers):
        ours, theirs = f"layers.{i}.mamba.", f"backbone.layers.{i}."
        table.append(Entry(f"layers.{i}.mamba_norm.weight", (theirs + "norm.weight",)))
        table += sublayer_entries(cfg, "mamba", ours, theirs + "mixer.")
        table += [Entry(ours + n, (f"{theirs}mixer.{n}",)) for n in biases]
    table.append(Entry("final_norm.weight", ("backbone.norm_f.weight",)))
    if not cfg.tie_embeddings:
        table.append(Entry("output.weight", ("lm_head.weight",), "vocab"))
    return table


def _number(value: object) -> float:
    """A float of config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)  # also "Infinity" / "inf" as strings


def _dt_limit(hf: dict) -> dict[str, float]:
    """mamba_dt_limit_min / _max from config.json's time_step_limit, the clamp transformers'
    Mamba-2 and Nemotron-H mixers apply to the step size ((0, inf) when absent; 0 is no maximum)."""
    low, high = (_number(v) for v in hf.get("time_step_limit") or (0.0, float("inf")))
    return {"mamba_dt_limit_min": low, "mamba_dt_limit_max": 0.0 if high == float("inf") else high}


def _hf_dt_limit(cfg: ModelConfig) -> list[float]:
    """config.json's time_step_limit for trireme's dt clamp."""
    return [cfg.mamba_dt_limit_min, cfg.mamba_dt_limit_max or float("inf")]


def mamba2_model_config(hf: dict, has_lm_head: bool) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig and notes for a mamba2 config.json."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported "
                              "(only silu)")
    h, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_heads"]
    notes = [f"Mamba-2 has no positional limit; model.seq_length is set to {DEFAULT_SEQ_LENGTH} "
             "(the longest trireme generates; change it freely)"]
    cfg = ModelConfig(
        num_layers=layers, layer_pattern="M" * layers, hidden_size=h,
        num_attention_heads=1,  # no attention layers; a value every width accepts
        vocab_size=hf["vocab_size"], seq_length=DEFAULT_SEQ_LENGTH, normalization="rmsnorm",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), bias=bool(hf.get("use_bias", False)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", not has_lm_head)),
        mamba_state_dim=hf["state_size"], mamba_head_dim=hf["head_dim"], mamba_num_heads=heads,
        mamba_num_groups=hf.get("n_groups", 1), mamba_conv_kernel=hf.get("conv_kernel", 4),
        mamba_conv_bias=bool(hf.get("use_conv_bias", True)),
        mamba_chunk_size=hf.get("chunk_size", 256),
        mamba_dt_min=float(hf.get("time_step_min", 0.001)),
        mamba_dt_max=float(hf.get("time_step_max", 0.1)),
        mamba_dt_init_floor=float(hf.get("time_step_floor", 1e-4)),
        **_dt_limit(hf),
    )
    cfg.mamba_expand = max(heads * cfg.mamba_head_dim // h, 1)
    return cfg, notes


def check_mamba2_exportable(cfg: ModelConfig) -> None:
    """A one-line error unless Mamba2ForCausalLM holds this model exactly."""
    if cfg.normalization != "rmsnorm":
        raise CheckpointError("Mamba2ForCausalLM uses RMSNorm; this model has "
                              f"model.normalization = {cfg.normalization!r}")
    if cfg.mamba_inner_size % cfg.hidden_size:
        raise CheckpointError(
            f"Mamba2ForCausalLM needs heads x head_dim = {cfg.mamba_inner_size} to be a "
            f"multiple of hidden_size = {cfg.hidden_size} (its `expand`)")


def mamba2_hf_config(cfg: ModelConfig) -> dict:
    """The keys of a mamba2 config.json (those common to every family are added by the caller)."""
    return {
        "architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_heads": cfg.mamba_heads, "head_dim": cfg.mamba_head_dim,
        "expand": cfg.mamba_inner_size // cfg.hidden_size, "state_size": cfg.mamba_state_dim,
        "n_groups": cfg.mamba_num_groups, "conv_kernel": cfg.mamba_conv_kernel,
        "use_conv_bias": cfg.mamba_conv_bias, "use_bias": cfg.bias, "hidden_act": "silu",
        "layer_norm_epsilon": cfg.norm_eps, "chunk_size": cfg.mamba_chunk_size,
        "time_step_min": cfg.mamba_dt_min, "time_step_max": cfg.mamba_dt_max,
        "time_step_floor": cfg.mamba_dt_init_floor,
        "time_step_limit": _hf_dt_limit(cfg),
        "residual_in_fp32": True, "rescale_prenorm_residual": False, "pad_token_id": None,
    }


def _sublayers(cfg: ModelConfig) -> list[tuple[int, str, str]]:
    """(trireme layer, sublayer name, kind) of every sublayer in pattern order."""
    out = []
    for j, kinds in enumerate(cfg.layer_kinds):
        out += [(j, name, kind) for name, kind in zip(sublayer_names(kinds), kinds)]
    return out


def nemotron_h_entries(cfg: ModelConfig) -> list[Entry]:
    """The table of a NemotronHForCausalLM model: HF block i is the pattern's sublayer i, its
    mixer holding the sublayer's weights under the names its class declares."""
    table = [Entry("embedding.weight", ("backbone.embeddings.weight",), "vocab")]
    for i, (j, name, kind) in enumerate(_sublayers(cfg)):
        table.append(Entry(f"layers.{j}.{name}_norm.weight", (f"backbone.layers.{i}.norm.weight",)))
        table += sublayer_entries(cfg, kind, f"layers.{j}.{name}.", f"backbone.layers.{i}.mixer.")
    table.append(Entry("final_norm.weight", ("backbone.norm_f.weight",)))
    if not cfg.tie_embeddings:
        table.append(Entry("output.weight", ("lm_head.weight",), "vocab"))
    return table


def nemotron_h_model_config(hf: dict, has_lm_head: bool) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig and notes for a nemotron_h config.json."""
    kinds = hf.get("layers_block_type") or []
    unknown = sorted({k for k in kinds if k not in BLOCK_KINDS or k == "moe"})
    if unknown or not kinds:
        raise CheckpointError(f"config.json: layers_block_type {unknown or kinds} is not "
                              "supported (Mamba, attention and MLP blocks convert; MoE not yet)")
    if hf.get("num_nextn_predict_layers"):
        raise CheckpointError("config.json: multi-token-prediction layers are not supported")
    acts = (hf.get("mlp_hidden_act", "relu2"), hf.get("mamba_hidden_act", "silu"))
    if acts != ("relu2", "silu"):
        raise CheckpointError(f"config.json: mlp_hidden_act / mamba_hidden_act = {acts} are not "
                              "supported (relu2 and silu)")
    biases = {bool(hf.get(k, False)) for k in ("use_bias", "attention_bias", "mlp_bias")}
    if len(biases) > 1:
        raise CheckpointError("config.json: use_bias, attention_bias and mlp_bias differ; "
                              "trireme has one bias switch")
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or h // heads
    cfg = ModelConfig(
        num_layers=sum(SYMBOL_OF[BLOCK_KINDS[k]] in MIXERS for k in kinds),
        layer_pattern="".join(SYMBOL_OF[BLOCK_KINDS[k]] for k in kinds), hidden_size=h,
        num_attention_heads=heads, num_query_groups=hf.get("num_key_value_heads") or heads,
        head_dim=0 if head_dim * heads == h else head_dim, ffn_hidden_size=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], seq_length=hf.get("max_position_embeddings", 4096),
        position_embedding="none", normalization="rmsnorm", activation="relu2",
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)), bias=biases.pop(),
        tie_embeddings=bool(hf.get("tie_word_embeddings", not has_lm_head)),
        mamba_state_dim=hf["ssm_state_size"], mamba_head_dim=hf["mamba_head_dim"],
        mamba_num_heads=hf["mamba_num_heads"], mamba_num_groups=hf.get("n_groups", 1),
        mamba_conv_kernel=hf.get("conv_kernel", 4),
        mamba_conv_bias=bool(hf.get("use_conv_bias", True)),
        mamba_chunk_size=hf.get("chunk_size", 128),
        mamba_dt_min=_number(hf.get("time_step_min", 0.001)),
        mamba_dt_max=_number(hf.get("time_step_max", 0.1)),
        mamba_dt_init_floor=_number(hf.get("time_step_floor", 1e-4)), **_dt_limit(hf),
    )
    cfg.mamba_expand = max(cfg.mamba_inner_size // h, 1)
    return cfg, []


def check_nemotron_h_exportable(cfg: ModelConfig) -> None:
    """A one-line error unless NemotronHForCausalLM holds this hybrid exactly."""
    lacking = [what for what, present in (
        ("mixture-of-experts layers", cfg.has_kind("moe")),
        (f"position_embedding = {cfg.position_embedding!r} (it has none)",
         cfg.position_embedding != "none" and cfg.has_kind("attention")),
        (f"activation = {cfg.activation!r} (it has relu2)",
         cfg.activation != "relu2" and cfg.has_kind("mlp")),
        ("layernorm", cfg.normalization != "rmsnorm"), ("qk-norm", cfg.qk_norm),
    ) if present]
    if lacking:
        raise CheckpointError("NemotronHForCausalLM (the Hugging Face hybrid) has no "
                              + ", ".join(lacking) + "; this model cannot be exported")


def nemotron_h_hf_config(cfg: ModelConfig) -> dict:
    """The keys of a nemotron_h config.json."""
    blocks = {kind: block for block, kind in BLOCK_KINDS.items()}
    return {
        "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
        "layers_block_type": [blocks[kind] for layer in cfg.layer_kinds for kind in layer],
        "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_size,
        "intermediate_size": cfg.ffn_size, "mlp_hidden_act": "relu2",
        "max_position_embeddings": cfg.seq_length, "layer_norm_epsilon": cfg.norm_eps,
        "use_bias": cfg.bias, "attention_bias": cfg.bias, "mlp_bias": cfg.bias,
        "mamba_num_heads": cfg.mamba_heads, "mamba_head_dim": cfg.mamba_head_dim,
        "ssm_state_size": cfg.mamba_state_dim, "n_groups": cfg.mamba_num_groups,
        "conv_kernel": cfg.mamba_conv_kernel, "use_conv_bias": cfg.mamba_conv_bias,
        "expand": max(cfg.mamba_inner_size // cfg.hidden_size, 1), "mamba_hidden_act": "silu",
        "chunk_size": cfg.mamba_chunk_size, "time_step_min": cfg.mamba_dt_min,
        "time_step_max": cfg.mamba_dt_max, "time_step_floor": cfg.mamba_dt_init_floor,
        "time_step_limit": _hf_dt_limit(cfg),
        "residual_in_fp32": False, "num_nextn_predict_layers": 0, "pad_token_id": None,
        "tie_word_embeddings": False,  # transformers never ties it: lm_head.weight is written
    }


def nemotron_h_with_head(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """The tensors of a NemotronHForCausalLM with lm_head.weight: a tied model's is a copy of the
    embedding, since transformers would leave a missing one newly initialised (it never ties)."""
    if "lm_head.weight" in tensors:
        return tensors
    return {**tensors, "lm_head.weight": tensors["backbone.embeddings.weight"].clone()}


def mamba_family(cfg: ModelConfig) -> str:
    """The Hugging Face family for a model with Mamba layers: mamba2 for "MMM...", else
    nemotron_h; a one-line error when that cannot hold it."""
    if cfg.kinds == ("mamba",):
        check_mamba2_exportable(cfg)
        return "mamba2"
    check_nemotron_h_exportable(cfg)
    return "nemotron_h"
