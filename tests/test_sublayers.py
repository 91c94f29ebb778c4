"""The sublayer registry: every kind of model.layer_pattern has a class, and what each class
declares without an instance (trireme.models.sublayer) agrees with the module it builds."""

import pytest

from trireme.config import FP8_LAYER_NAMES, KINDS, MIXERS, NOT_YET, ModelConfig
from trireme.models.block import SUBLAYERS
from trireme.models.sublayer import Shape
from trireme.parallel.context import ParallelContext


def config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, layer_pattern="*-ME", hidden_size=32, num_attention_heads=4,
                  num_query_groups=2, ffn_hidden_size=48, vocab_size=64, seq_length=16,
                  qk_norm=True, moe_num_experts=4, moe_top_k=2, moe_ffn_hidden_size=24,
                  moe_shared_ffn_hidden_size=8, mamba_state_dim=8, mamba_head_dim=8,
                  mamba_num_groups=2)
    return ModelConfig(**{**values, **overrides})


def test_every_kind_of_the_pattern_has_its_class():
    assert set(SUBLAYERS) == {kind for symbol, kind in KINDS.items() if symbol not in NOT_YET}
    for kind, cls in SUBLAYERS.items():
        assert cls.kind == kind and KINDS[cls.symbol] == kind
        assert cls.mixes == (cls.symbol in MIXERS)


@pytest.mark.parametrize("overrides", [{}, {"bias": True, "activation": "gelu"},
                                       {"qkv_bias": True, "qk_norm": False}])
@pytest.mark.parametrize("kind", ["attention", "mlp", "moe"])
def test_declared_parameters_are_those_the_module_holds(kind, overrides):
    cfg = config(**overrides)
    module = SUBLAYERS[kind](cfg, ParallelContext())
    declared = SUBLAYERS[kind].params(cfg, tensor=1, expert=1)
    assert declared.dense + declared.experts == sum(p.numel() for p in module.parameters())
    assert declared.largest == max(p.numel() for p in module.parameters())


@pytest.mark.parametrize("kind", sorted(SUBLAYERS))
@pytest.mark.parametrize("overrides", [{}, {"qk_norm": False, "mamba_conv_bias": False},
                                       {"activation": "relu2"}])
def test_checkpoint_names_are_tensors_of_the_module(kind, overrides):
    cfg = config(**overrides)
    state = SUBLAYERS[kind](cfg, ParallelContext()).state_dict()
    names = SUBLAYERS[kind].hf_names(cfg)
    assert set(names) <= set(state), set(names) - set(state)
    weights = {n for n in state if n.endswith("weight") and n.count(".") == 1 and "norm" not in n}
    if kind in ("attention", "mlp", "mamba"):  # all their weights have Hugging Face names
        assert weights <= set(names)


@pytest.mark.parametrize("kind", sorted(SUBLAYERS))
def test_flops_on_one_rank_split_into_linear_and_core(kind):
    cfg = config()
    linear, core = SUBLAYERS[kind].rank_flops(cfg, 1)
    assert linear + core == SUBLAYERS[kind].flops(cfg) > 0
    assert (core > 0) == (kind == "attention")


@pytest.mark.parametrize("kind", sorted(SUBLAYERS))
def test_fp8_linears_are_the_modules_linears(kind):
    cfg = config()
    module = SUBLAYERS[kind](cfg, ParallelContext())
    q, k = cfg.num_attention_heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    s = Shape(e=2, h=cfg.hidden_size, q=q, k=k, heads=cfg.num_attention_heads,
              ffn=cfg.ffn_size, tensor=1, sequence_parallel=False, context=1,
              context_mode="allgather", fp8=True, norm_fused=False, layernorm=False,
              swiglu=True, activation_recomputed=False, compiled=False, fused_loss=False)
    for name, (inputs, outputs) in SUBLAYERS[kind].fp8_linears(s).items():
        assert name in FP8_LAYER_NAMES
        assert tuple(getattr(module, name).weight.shape) == (outputs, inputs)
