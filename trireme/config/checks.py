"""Typed configuration, part 4: `validate`, the checks that values fit together (one-line
ConfigErrors naming the value and the fix)."""

from __future__ import annotations

from trireme.config.model import (
    AUTO_MICRO_BATCH,
    FP8_AUTO,
    FP8_LAYER_NAMES,
    FP8_OUTPUT,
    KERNEL_NAMES,
    NOT_YET,
    SYMBOLS,
    ModelConfig,
)
from trireme.config.sections import Config, OptimizerConfig, ParallelConfig
from trireme.config.values import check_types
from trireme.errors import ConfigError
from trireme.words import count_of


def validate(cfg: Config, need_vocab: bool = True) -> None:
    """Check each value's type (values set in code too) and that values fit together; raise
    ConfigError naming the value and the fix."""
    check_types(cfg)
    _check_ranges(cfg)
    _check_model(cfg, need_vocab)
    _check_train(cfg)
    _check_optimizer_and_data(cfg)


def _check_ranges(cfg: Config) -> None:
    """Counts and sizes that must be positive (or not negative)."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    for name, v in [
        ("model.num_layers", m.num_layers),
        ("model.hidden_size", m.hidden_size),
        ("model.num_attention_heads", m.num_attention_heads),
        ("model.seq_length", m.seq_length),
        ("train.global_batch_size", t.global_batch_size),
        ("parallel.tensor", p.tensor),
        ("parallel.pipeline", p.pipeline),
        ("parallel.virtual_pipeline", p.virtual_pipeline),
        ("parallel.context", p.context),
        ("parallel.expert", p.expert),
        ("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by),
    ]:
        if v < 1:
            raise ConfigError(f"{name} = {v} must be at least 1")
    if not p.timeout_minutes > 0:
        raise ConfigError(f"parallel.timeout_minutes = {p.timeout_minutes} must be > 0, e.g. 10")
    if cfg.logging.straggler_factor < 0 or 0 < cfg.logging.straggler_factor <= 1:
        raise ConfigError(f"logging.straggler_factor = {cfg.logging.straggler_factor} must be > 1 "
                          "(e.g. 1.2), or 0 to turn the per-rank timing off")
    if t.eval_interval and t.eval_steps < 1:
        raise ConfigError(f"train.eval_steps = {t.eval_steps} must be at least 1 (batches per "
                          "evaluation); train.eval_interval = 0 turns evaluation off")
    for name, v in [
        ("model.num_query_groups", m.num_query_groups),
        ("model.head_dim", m.head_dim),
        ("model.max_position_embeddings", m.max_position_embeddings),
        ("model.ffn_hidden_size", m.ffn_hidden_size),
        ("model.vocab_size", m.vocab_size),
        ("train.steps", t.steps),
        ("train.eval_interval", t.eval_interval),
        ("train.eval_steps", t.eval_steps),
        ("train.cpu_threads", t.cpu_threads),
        ("checkpoint.interval", cfg.checkpoint.interval),
        ("train.recompute_layers", t.recompute_layers),
        ("checkpoint.keep_last", cfg.checkpoint.keep_last),
        ("schedule.warmup_steps", cfg.schedule.warmup_steps),
        ("schedule.decay_steps", cfg.schedule.decay_steps),
        ("train.max_skipped_steps", t.max_skipped_steps),
        ("train.spike_window", t.spike_window),
        ("train.spike_zscore", t.spike_zscore),
        ("train.max_minutes", t.max_minutes),
        ("model.init_std", m.init_std),
        ("model.norm_eps", m.norm_eps),
    ]:
        if v < 0:
            raise ConfigError(f"{name} = {v} must not be negative")
    if t.log_interval < 1:
        raise ConfigError(f"train.log_interval = {t.log_interval} must be at least 1")
    if m.rope_theta <= 0:
        raise ConfigError(f"model.rope_theta = {m.rope_theta} must be > 0, e.g. 10000")


def _check_model(cfg: Config, need_vocab: bool) -> None:
    m, p = cfg.model, cfg.parallel
    pending = sorted(set("".join(m.layer_symbols)) & set(NOT_YET))  # raises on a bad pattern
    if pending:
        symbol = pending[0]
        raise ConfigError(f"model.layer_pattern: {symbol!r} ({SYMBOLS[symbol]}) is not "
                          f"implemented yet ({NOT_YET[symbol]}); use *, - and E")
    if m.has_kind("moe"):
        _check_moe(m, p)
    if m.has_kind("mamba"):
        _check_mamba(m, p)
        for key in ("reset_attention_mask", "pack_conversations"):
            if getattr(cfg.data, key):  # the recurrent state would run across the documents
                raise ConfigError(f"data.{key} (packed documents) with Mamba-2 layers (M) is "
                                  "not implemented yet; set it to false")
    if m.head_dim == 0 and m.hidden_size % m.num_attention_heads:
        raise ConfigError(
            f"model.hidden_size = {m.hidden_size} is not divisible by model.num_attention_heads = "
            f"{m.num_attention_heads}; change one of them or set model.head_dim"
        )
    if m.num_attention_heads % m.kv_heads:
        raise ConfigError(
            f"model.num_attention_heads = {m.num_attention_heads} is not divisible by "
            f"model.num_query_groups = {m.num_query_groups}"
        )
    if m.position_embedding == "rope" and m.head_size % 2:
        raise ConfigError(f"rotary embeddings need an even head size, got {m.head_size}")
    if m.position_embedding == "learned" and m.max_position_embeddings not in (0, m.seq_length):
        raise ConfigError(f"model.max_position_embeddings = {m.max_position_embeddings} with "
                          f"learned positions: the table holds model.seq_length = {m.seq_length} "
                          "positions; set it to 0")
    unknown = sorted(set(m.kernels) - set(KERNEL_NAMES))
    if unknown:
        raise ConfigError(f"model.kernels has unknown kernel(s) {unknown}; choose from "
                          f"{list(KERNEL_NAMES)}")
    if "liger_swiglu" in m.kernels and m.fused_swiglu:
        raise ConfigError("model.kernels names liger_swiglu and model.fused_swiglu = true: both "
                          "replace SwiGLU; drop one")
    _check_fp8(m)
    check_fp8_tensor(m, p)
    if not 0.0 <= m.dropout < 1.0:
        raise ConfigError(f"model.dropout = {m.dropout} must be in [0, 1)")
    if need_vocab and m.vocab_size < 1:
        raise ConfigError("model.vocab_size must be set (or taken from the tokenizer)")
    if m.fused_cross_entropy != "false" and m.loss_chunk_size < 1:
        raise ConfigError(
            f"model.loss_chunk_size = {m.loss_chunk_size} must be at least 1 with "
            "model.fused_cross_entropy = true"
        )


def _check_fp8(m: ModelConfig) -> None:
    """model.fp8_layers, fp8_scaling and fp8_amax_history, and what they need. The "auto"
    defaults resolve to what the config can run (ModelConfig.fp8_layer_names /
    fp8_scaling_mode); only values named explicitly are held to their needs here."""
    names = [*FP8_LAYER_NAMES, FP8_OUTPUT]
    unknown = sorted(set(m.fp8_layers) - {*names, FP8_AUTO})
    if unknown:
        raise ConfigError(f"model.fp8_layers has unknown layer(s) {unknown}; choose from "
                          f"{names} or [\"auto\"]")
    if FP8_AUTO in m.fp8_layers and len(m.fp8_layers) > 1:
        raise ConfigError(f"model.fp8_layers = {m.fp8_layers} mixes 'auto' with layer names; "
                          "write ['auto'] alone or name the layers")
    fp8 = m.precision == "fp8"
    if FP8_OUTPUT in m.fp8_layers:
        if not fp8:
            raise ConfigError(f"model.fp8_layers names 'output' with model.precision = "
                              f"{m.precision!r}; set model.precision = 'fp8' or drop 'output'")
        if m.fused_cross_entropy == "false":
            raise ConfigError("model.fp8_layers 'output' runs in the fused cross-entropy; set "
                              "model.fused_cross_entropy = true (or auto) or drop 'output'")
        if "liger_cross_entropy" in m.kernels:
            raise ConfigError("model.fp8_layers 'output' and model.kernels liger_cross_entropy "
                              "both replace the output layer's loss; drop one")
    if m.fp8_scaling == "delayed":
        if not fp8:
            raise ConfigError(f"model.fp8_scaling = 'delayed' with model.precision = "
                              f"{m.precision!r}; set model.precision = 'fp8' or fp8_scaling = "
                              "'auto'")
        if m.fp8_backend != "trireme":
            raise ConfigError("model.fp8_scaling = 'delayed' needs model.fp8_backend = "
                              "'trireme' (torchao's is current scaling)")
    if m.fp8_amax_history < 1:
        raise ConfigError(f"model.fp8_amax_history = {m.fp8_amax_history} must be at least 1")


def _check_moe(m: ModelConfig, p: ParallelConfig) -> None:
    """The mixture-of-experts keys, when the pattern has an E."""
    if m.moe_num_experts < 1:
        raise ConfigError(f"model.moe_num_experts = {m.moe_num_experts} must be at least 1 with "
                          "E layers in model.layer_pattern")
    if not 1 <= m.moe_top_k <= m.moe_num_experts:
        raise ConfigError(f"model.moe_top_k = {m.moe_top_k} must be between 1 and "
                          f"model.moe_num_experts = {m.moe_num_experts}")
    if m.moe_num_groups < 1 or m.moe_num_experts % m.moe_num_groups:
        raise ConfigError(f"model.moe_num_groups = {m.moe_num_groups} must divide "
                          f"model.moe_num_experts = {m.moe_num_experts}")
    per_group = m.moe_num_experts // m.moe_num_groups
    if not 1 <= m.moe_top_groups <= m.moe_num_groups or m.moe_top_k > m.moe_top_groups * per_group:
        raise ConfigError(f"model.moe_top_groups = {m.moe_top_groups} must be between 1 and "
                          f"model.moe_num_groups = {m.moe_num_groups} and hold model.moe_top_k = "
                          f"{count_of(m.moe_top_k, 'expert')}")
    if m.moe_capacity_factor < 0:
        raise ConfigError(f"model.moe_capacity_factor = {m.moe_capacity_factor} must be > 0 "
                          "(or 0: dropless)")
    if m.moe_pad_to_capacity and not m.moe_capacity_factor:
        raise ConfigError("model.moe_pad_to_capacity needs a capacity (model.moe_capacity_factor "
                          "> 0): dropless routing has none to pad to")
    for key in ("moe_aux_loss_coeff", "moe_seq_aux_loss_coeff", "moe_z_loss_coeff",
                "moe_bias_update_rate"):
        if getattr(m, key) < 0:
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be >= 0 (0: off)")
    check_expert_split(m, p)
    if m.moe_dispatcher not in ("alltoall", "allgather"):
        raise ConfigError(f"model.moe_dispatcher = {m.moe_dispatcher!r}: use 'alltoall' or "
                          "'allgather'")
    check_expert_capacity(m, p)
    check_moe_tensor(m, p)


def _check_mamba(m: ModelConfig, p: ParallelConfig) -> None:
    """The Mamba-2 keys, when the pattern has an M."""
    for key in ("mamba_state_dim", "mamba_head_dim"):
        if getattr(m, key) < 1:
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be at least 1 with Mamba-2 "
                              "layers (M) in model.layer_pattern; e.g. mamba_state_dim = 128, "
                              "mamba_head_dim = 64 (16 and 16 for a tiny model)")
    for key in ("mamba_num_heads", "mamba_expand", "mamba_num_groups", "mamba_conv_kernel",
                "mamba_chunk_size"):
        if getattr(m, key) < (0 if key == "mamba_num_heads" else 1):
            raise ConfigError(f"model.{key} = {getattr(m, key)} must be at least 1")
    if not m.mamba_num_heads and (m.mamba_expand * m.hidden_size) % m.mamba_head_dim:
        raise ConfigError(f"model.mamba_expand x hidden_size = {m.mamba_expand * m.hidden_size} "
                          f"is not divisible by model.mamba_head_dim = {m.mamba_head_dim}; "
                          "change one or set model.mamba_num_heads")
    heads, groups = m.mamba_heads, m.mamba_num_groups
    if heads % groups:
        raise ConfigError(f"model.mamba_num_groups = {groups} must divide the {heads} Mamba "
                          "heads (each group's B and C serve whole heads)")
    check_mamba_tensor(m, p)
    if not 0 < m.mamba_dt_min <= m.mamba_dt_max or m.mamba_dt_init_floor < 0:
        raise ConfigError(f"model.mamba_dt_min = {m.mamba_dt_min} and mamba_dt_max = "
                          f"{m.mamba_dt_max} must satisfy 0 < dt_min <= dt_max")
    if not 0 < m.mamba_a_init_min <= m.mamba_a_init_max:
        raise ConfigError(f"model.mamba_a_init_min = {m.mamba_a_init_min} and mamba_a_init_max "
                          f"= {m.mamba_a_init_max} must satisfy 0 < min <= max")
    if m.mamba_dt_limit_min < 0 or 0 < m.mamba_dt_limit_max < m.mamba_dt_limit_min:
        raise ConfigError(f"model.mamba_dt_limit_min = {m.mamba_dt_limit_min} and "
                          f"mamba_dt_limit_max = {m.mamba_dt_limit_max}: need 0 <= min <= max "
                          "(max 0: no upper limit)")


def check_degrees(cfg: Config) -> None:
    """The rules between the model and the parallel degrees that `validate` checks too (each a
    small function, called from trireme.parallel.layout.resolve_layout)."""
    m, p = cfg.model, cfg.parallel
    check_fp8_tensor(m, p)
    if m.has_kind("moe"):
        check_expert_split(m, p)
        check_expert_capacity(m, p)
        check_moe_tensor(m, p)
    if m.has_kind("mamba"):
        check_mamba_tensor(m, p)


def check_fp8_tensor(m: ModelConfig, p: ParallelConfig) -> None:
    if m.precision == "fp8" and p.tensor > 1:
        raise ConfigError("model.precision = 'fp8' with parallel.tensor > 1 is not supported yet; "
                          "use parallel.tensor = 1 or model.precision = 'bf16'")


def check_expert_split(m: ModelConfig, p: ParallelConfig) -> None:
    """Each expert-parallel rank holds a whole number of experts."""
    if m.moe_num_experts % p.expert:
        raise ConfigError(f"model.moe_num_experts = {m.moe_num_experts} is not divisible by "
                          f"parallel.expert = {p.expert}")


def check_expert_capacity(m: ModelConfig, p: ParallelConfig) -> None:
    if p.expert > 1 and m.moe_pad_to_capacity:
        raise ConfigError("model.moe_pad_to_capacity with parallel.expert > 1: not supported "
                          "(the tokens each rank receives vary anyway); set it to false")


def check_moe_tensor(m: ModelConfig, p: ParallelConfig) -> None:
    """The tensor-parallel ranks of a mixture-of-experts layer share the tokens."""
    if p.tensor > 1 and m.seq_length % p.tensor:
        raise ConfigError(f"model.seq_length = {m.seq_length} must be divisible by "
                          f"parallel.tensor = {p.tensor} with mixture-of-experts layers (the "
                          "TP ranks share the tokens)")


def check_mamba_tensor(m: ModelConfig, p: ParallelConfig) -> None:
    """Each tensor-parallel rank holds whole Mamba groups."""
    if m.mamba_num_groups % p.tensor:
        raise ConfigError(f"model.mamba_num_groups = {m.mamba_num_groups} is not divisible by "
                          f"parallel.tensor = {p.tensor}; each tensor-parallel rank holds whole "
                          "groups (and their heads)")


def _check_train(cfg: Config) -> None:
    m, t = cfg.model, cfg.train
    if t.recompute_layers > m.num_layers:
        raise ConfigError(f"train.recompute_layers = {t.recompute_layers} is more than "
                          f"model.num_layers = {m.num_layers}; use 0 for all layers")
    if t.recompute_layers and t.recompute != "full":
        raise ConfigError(
            f"train.recompute_layers = {t.recompute_layers} needs train.recompute = \"full\" "
            f"(it is {t.recompute!r}); set it to 0 or use full recomputation"
        )
    if cfg.checkpoint.async_save and cfg.checkpoint.format != "sharded":
        raise ConfigError("checkpoint.async_save = true needs checkpoint.format = 'sharded' "
                          f"(it is {cfg.checkpoint.format!r})")
    if t.micro_batch_size < AUTO_MICRO_BATCH:
        raise ConfigError(f"train.micro_batch_size = {t.micro_batch_size}: use a positive size, "
                          "0 (derived from the launch) or -1 (auto: fit the device)")
    if t.micro_batch_size > 0 and t.global_batch_size % t.micro_batch_size:
        raise ConfigError(
            f"train.global_batch_size = {t.global_batch_size} is not divisible by "
            f"train.micro_batch_size = {t.micro_batch_size} (times the data-parallel degree)"
        )
    if t.spike_rollback and not (cfg.checkpoint.dir and t.spike_window and t.spike_zscore):
        raise ConfigError("train.spike_rollback = true needs checkpoint.dir (the checkpoint to "
                          "roll back to) and spike detection on (train.spike_window > 0, "
                          "train.spike_zscore > 0)")


def _check_optimizer_and_data(cfg: Config) -> None:
    _check_optimizer(cfg.optimizer)
    if not 0.0 <= cfg.schedule.wsd_decay_fraction <= 1.0:
        raise ConfigError("schedule.wsd_decay_fraction must be in [0, 1]")
    for kind in cfg.optimizer.no_decay:
        if kind not in ("norm", "bias", "embedding", "ssm"):
            raise ConfigError(
                f"optimizer.no_decay entry {kind!r} is not one of: norm, bias, embedding, ssm"
            )
    try:
        shares = [float(s) for s in cfg.data.split.split(",")]
    except ValueError:
        shares = []
    if len(shares) != 3 or any(s < 0 for s in shares) or shares[0] <= 0:
        raise ConfigError(
            f"data.split = {cfg.data.split!r} must be three non-negative weights like '969,30,1'"
        )


def _check_optimizer(o: OptimizerConfig) -> None:
    """AdamW's and the loss scaler's values (torch's own checks would be tracebacks)."""
    if o.lr < 0 or o.min_lr < 0:
        raise ConfigError("optimizer.lr and optimizer.min_lr must not be negative")
    if o.min_lr > o.lr:
        raise ConfigError(f"optimizer.min_lr = {o.min_lr} exceeds optimizer.lr = {o.lr}")
    for name, v in [("optimizer.beta1", o.beta1), ("optimizer.beta2", o.beta2)]:
        if not 0.0 <= v < 1.0:
            raise ConfigError(f"{name} = {v} must be in [0, 1), e.g. 0.9 or 0.95")
    for name, v in [("optimizer.eps", o.eps), ("optimizer.weight_decay", o.weight_decay),
                    ("optimizer.clip_grad", o.clip_grad)]:
        if v < 0:
            raise ConfigError(f"{name} = {v} must not be negative"
                              + (" (0 turns clipping off)" if name.endswith("clip_grad") else ""))
    if o.initial_loss_scale <= 0 or o.min_loss_scale <= 0 or o.loss_scale_window < 1:
        raise ConfigError(f"optimizer.initial_loss_scale = {o.initial_loss_scale} and "
                          f"min_loss_scale = {o.min_loss_scale} must be > 0 and "
                          f"loss_scale_window = {o.loss_scale_window} at least 1")
    if o.min_loss_scale > o.initial_loss_scale:
        raise ConfigError(f"optimizer.min_loss_scale = {o.min_loss_scale} exceeds "
                          f"optimizer.initial_loss_scale = {o.initial_loss_scale}")
