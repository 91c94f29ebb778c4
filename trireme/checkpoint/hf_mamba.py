"""Hugging Face's Mamba-2 (`Mamba2ForCausalLM`, model_type mamba2), both ways.

Every layer is one Mamba-2 mixer after an RMSNorm, which is trireme's `M` sublayer
(trireme.models.mamba) with the pattern "M" * num_layers:

    backbone.embeddings.weight                -> embedding.weight
    backbone.layers.i.norm.weight             -> layers.i.mamba_norm.weight
    backbone.layers.i.mixer.{in_proj, conv1d, dt_bias, A_log, D, norm, out_proj}
                                              -> layers.i.mamba.{the same names}
    backbone.norm_f.weight                    -> final_norm.weight
    lm_head.weight                            -> output.weight (absent when tied)

The tensors have the same layout on both sides (in_proj rows [z; x; B; C; dt], the
convolution over [x; B; C], the gated norm per group of d_in / n_groups channels), so every entry
is a copy. transformers' `residual_in_fp32` keeps the residual stream in fp32 in a bf16 model,
which trireme does not: logits agree in fp32 and differ by bf16 rounding otherwise.
"""

from __future__ import annotations

from trireme.checkpoint.hf_table import Entry
from trireme.config import ModelConfig
from trireme.errors import CheckpointError

MAMBA_TYPES = ("mamba2",)
MIXER_TENSORS = ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight",
                 "out_proj.weight")
DEFAULT_SEQ_LENGTH = 4096  # Mamba-2 has no positional limit; trireme's generation stops here


def mamba2_entries(cfg: ModelConfig) -> list[Entry]:
    """The table of a Mamba2ForCausalLM model."""
    table = [Entry("embedding.weight", ("backbone.embeddings.weight",), "vocab")]
    names = list(MIXER_TENSORS)
    if cfg.mamba_conv_bias:
        names.append("conv1d.bias")
    if cfg.bias:
        names += ["in_proj.bias", "out_proj.bias"]
    for i in range(cfg.num_layers):
        theirs = f"backbone.layers.{i}."
        table.append(Entry(f"layers.{i}.mamba_norm.weight", (theirs + "norm.weight",)))
        table += [Entry(f"layers.{i}.mamba.{n}", (f"{theirs}mixer.{n}",)) for n in names]
    table.append(Entry("final_norm.weight", ("backbone.norm_f.weight",)))
    if not cfg.tie_embeddings:
        table.append(Entry("output.weight", ("lm_head.weight",), "vocab"))
    return table


def _number(value: object) -> float:
    """A float of config.json, where transformers 5 writes infinity as {"__float__": "Infinity"}."""
    if isinstance(value, dict) and "__float__" in value:
        value = value["__float__"]
    return float(value)  # also "Infinity" / "inf" as strings


def mamba2_model_config(hf: dict, has_lm_head: bool) -> tuple[ModelConfig, list[str]]:
    """The ModelConfig and notes for a mamba2 config.json."""
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"config.json: hidden_act {hf['hidden_act']!r} is not supported "
                              "(only silu)")
    h, layers, heads = hf["hidden_size"], hf["num_hidden_layers"], hf["num_heads"]
    limit = hf.get("time_step_limit") or (0.0, float("inf"))
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
        mamba_dt_limit_min=_number(limit[0]),
        mamba_dt_limit_max=0.0 if _number(limit[1]) == float("inf") else _number(limit[1]),
    )
    cfg.mamba_expand = max(heads * cfg.mamba_head_dim // h, 1)
    return cfg, notes


def check_mamba2_exportable(cfg: ModelConfig) -> None:
    """A one-line error unless Mamba2ForCausalLM holds this model exactly."""
    if set(cfg.layer_pattern) != {"M"}:
        raise CheckpointError(
            f"model.layer_pattern = {cfg.layer_pattern!r}: Hugging Face's Mamba2ForCausalLM has "
            "Mamba-2 layers only (pattern 'MMM...'); hybrids have no exporter yet")
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
        "time_step_limit": [cfg.mamba_dt_limit_min, cfg.mamba_dt_limit_max or float("inf")],
        "residual_in_fp32": True, "rescale_prenorm_residual": False, "pad_token_id": None,
    }
