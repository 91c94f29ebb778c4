"""The mixture-of-experts families of Hugging Face: Mixtral and Qwen3-MoE, both ways.

Both are Llama-style decoders (convert_hf.py) whose MLP is, in some layers, a router plus E
SwiGLU experts, stored one nn.Linear per expert and projection:

    Mixtral     model.layers.i.block_sparse_moe.{gate, experts.e.w1 (gate), w3 (up), w2 (down)}
    Qwen3-MoE   model.layers.i.mlp.{gate, experts.e.gate_proj, up_proj, down_proj}

(transformers 5 fuses the experts in memory, `experts.gate_up_proj`, but saves and loads these
per-expert names.) trireme's `E` sublayer holds the same weights as `router.weight` [E, h],
`experts.fc1` [E, h, 2F] (expert e's gate and up as columns) and `experts.fc2` [E, F, h].

Routing: Mixtral takes the top-k of the softmax and renormalizes them, which is trireme's
`topk_softmax`; Qwen3-MoE does the same with `norm_topk_prob`, else keeps the probabilities as
they are (`softmax`). Qwen3-MoE's layer i is sparse unless it is in `mlp_only_layers`, and only
when (i + 1) is a multiple of `decoder_sparse_step`: model.layer_pattern spells that out, `*E` per
sparse layer and `*-` per dense one (whose MLP has `intermediate_size`).
"""

from __future__ import annotations

from trireme.config import ModelConfig
from trireme.convert.hf_table import Entry, sublayer_entries
from trireme.errors import CheckpointError

MOE_TYPES = ("mixtral", "qwen3_moe")
# model_type -> (the MLP's module, an expert's gate, up and down projections); the router's name
# is the one trireme.models.moe.MoE declares (hf_names)
NAMES = {
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
}
ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def moe_entries(cfg: ModelConfig, i: int, kind: str, biases: tuple[bool, ...] = ()) -> list[Entry]:
    """The table rows of layer i's MoE sublayer (its norm included) in family `kind` (biases:
    none)."""
    block, gate, up, down = NAMES[kind]
    ours, m = f"layers.{i}.", f"model.layers.{i}.{block}."
    experts = range(cfg.moe_num_experts)
    ffn = cfg.moe_ffn_size
    return [
        Entry(ours + "moe_norm.weight", (f"model.layers.{i}.post_attention_layernorm.weight",)),
        *sublayer_entries(cfg, "moe", ours + "moe.", m),
        Entry(ours + "moe.experts.fc1",
              tuple(f"{m}experts.{e}.{p}.weight" for e in experts for p in (gate, up)),
              "experts", (ffn, ffn)),
        Entry(ours + "moe.experts.fc2", tuple(f"{m}experts.{e}.{down}.weight" for e in experts),
              "experts", (cfg.hidden_size,)),
    ]


def moe_fields(hf: dict, kind: str) -> dict:
    """The model.moe_* keys and the layer pattern a Mixtral / Qwen3-MoE config.json asks for."""
    experts = hf.get("num_local_experts") or hf.get("num_experts") or 0
    layers = hf["num_hidden_layers"]
    if kind == "mixtral":
        sparse, ffn, router = [True] * layers, hf["intermediate_size"], "topk_softmax"
    else:
        step, dense = hf.get("decoder_sparse_step", 1) or 1, set(hf.get("mlp_only_layers") or [])
        sparse = [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)]
        ffn = hf["moe_intermediate_size"]
        router = "topk_softmax" if hf.get("norm_topk_prob", False) else "softmax"
    return dict(
        layer_pattern="".join("*E" if s else "*-" for s in sparse), moe_num_experts=experts,
        moe_top_k=hf["num_experts_per_tok"], moe_ffn_hidden_size=ffn, moe_router=router,
        moe_aux_loss_coeff=float(hf.get("router_aux_loss_coef", 0.0)))


def choose_moe_architecture(cfg: ModelConfig) -> str:
    """Mixtral or Qwen3-MoE, whichever holds this MoE model exactly; else a one-line error."""
    symbols = cfg.layer_symbols
    neither = [what for what, present in (
        ("layers other than *- and *E", any(s not in ("*-", "*E") for s in symbols)),
        ("shared expert", cfg.moe_shared_ffn_hidden_size > 0),
        ("sigmoid router", cfg.moe_router == "sigmoid"),
        ("group-limited routing", cfg.moe_num_groups > 1),
        ("routing weight scale", cfg.moe_score_scale != 1.0)) if present]
    if neither:
        raise CheckpointError("no Hugging Face MoE architecture (Mixtral, Qwen3-MoE) has a "
                              + ", ".join(neither))
    if cfg.qk_norm:
        return "qwen3_moe"
    not_mixtral = [what for what, present in (
        ("softmax router without renormalization", cfg.moe_router != "topk_softmax"),
        ("dense layers", "*-" in symbols), ("biases", cfg.bias or cfg.qkv_bias)) if present]
    if not_mixtral:
        raise CheckpointError(f"Mixtral has no {', '.join(not_mixtral)}, and a model without "
                              "QK-norm is no Qwen3-MoE: no Hugging Face architecture holds it")
    return "mixtral"


def moe_hf_config(cfg: ModelConfig, kind: str) -> dict:
    """The MoE keys of a Mixtral / Qwen3-MoE config.json."""
    common = {"num_experts_per_tok": cfg.moe_top_k, "router_aux_loss_coef": cfg.moe_aux_loss_coeff,
              "output_router_logits": False, "sliding_window": None}
    if kind == "mixtral":
        return {**common, "num_local_experts": cfg.moe_num_experts,
                "intermediate_size": cfg.moe_ffn_size}
    dense = [i for i, layer in enumerate(cfg.layer_symbols) if layer == "*-"]
    return {**common, "num_experts": cfg.moe_num_experts, "moe_intermediate_size": cfg.moe_ffn_size,
            "norm_topk_prob": cfg.moe_router == "topk_softmax", "decoder_sparse_step": 1,
            "mlp_only_layers": dense, "use_sliding_window": False}
