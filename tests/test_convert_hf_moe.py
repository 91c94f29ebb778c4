"""Mixture-of-experts models to and from Hugging Face (Mixtral, Qwen3-MoE), the full-size MoE
presets, and the FLOPs that MFU counts for them (the active experts only).

Logits are the test: tiny random `transformers` models built here (no download), fp32 on CPU,
must give the same logits in trireme, and trireme's export must give them back in transformers;
`trireme generate --greedy` must continue a prompt as HF's greedy `generate` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.converted import assert_exports_back, assert_generate_matches_hf, trireme_model
from trireme.checkpoint.model_state import expected_shapes
from trireme.cli import main
from trireme.config import ModelConfig, load_config
from trireme.convert.convert import convert
from trireme.convert.hf import read_hf, write_hf
from trireme.errors import CheckpointError
from trireme.metrics import flops_per_token
from trireme.models.gpt import GPT

transformers = pytest.importorskip("transformers")

VOCAB = 100
BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
HF_MODELS = {  # name: (class prefix, config), each seeded and made in the test
    "mixtral": ("Mixtral", dict(intermediate_size=48, num_local_experts=4, rope_theta=1e6)),
    "qwen3-moe-renormalized": ("Qwen3Moe", dict(
        intermediate_size=96, moe_intermediate_size=32, num_experts=6, head_dim=32,
        norm_topk_prob=True, mlp_only_layers=[0], tie_word_embeddings=True)),
    "qwen3-moe-every-second": ("Qwen3Moe", dict(
        intermediate_size=80, moe_intermediate_size=24, num_experts=4, norm_topk_prob=False,
        decoder_sparse_step=2, num_experts_per_tok=3)),
}
PATTERNS = {"mixtral": "*E*E*E", "qwen3-moe-renormalized": "*-*E*E",
            "qwen3-moe-every-second": "*-*E*-"}
ROUTERS = {"mixtral": "topk_softmax", "qwen3-moe-renormalized": "topk_softmax",
           "qwen3-moe-every-second": "softmax"}


def make_hf(name: str, folder: Path) -> torch.nn.Module:
    prefix, extra = HF_MODELS[name]
    config = getattr(transformers, prefix + "Config")(**{**BASE, **extra})
    torch.manual_seed(0)
    model = getattr(transformers, prefix + "ForCausalLM")(config).eval()
    with torch.no_grad():  # norms and weights away from their trivial init: routing matters
        for p in model.parameters():
            p.normal_(0.3, 0.2) if p.dim() == 1 else p.normal_(0.0, 0.15)
    model.save_pretrained(folder)
    return model


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"max |diff| {diff}"  # (logits here are at most about 2)


@pytest.mark.parametrize("name", list(HF_MODELS))
def test_hf_moe_both_ways_same_logits(tmp_path: Path, capsys, name: str) -> None:
    hf = make_hf(name, tmp_path / "hf")
    assert main(["inspect", str(tmp_path / "hf")]) == 0
    summary = f"{PATTERNS[name].count('E')} MoE layers ({hf.config.num_local_experts} experts"
    assert summary in capsys.readouterr().out
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    assert want.std() > 0.1
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    model = trireme_model(tmp_path / "tri")
    assert model.cfg.layer_pattern == PATTERNS[name]
    assert model.cfg.moe_router == ROUTERS[name]
    with torch.no_grad():
        assert_close(model(ids), want)

    assert_exports_back(tmp_path, hf, ids, want, assert_close)


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe-renormalized"])
def test_trireme_generate_greedy_continues_as_hf(tmp_path: Path, capsys, name: str) -> None:
    hf = make_hf(name, tmp_path / "hf")
    prompt = [5, 17, 42, 3, 61]
    assert_generate_matches_hf(tmp_path, hf, prompt, VOCAB - 1, capsys)


def test_hf_moe_bad_input(tmp_path: Path) -> None:
    qwen2 = transformers.Qwen2MoeConfig(**{**BASE, "num_experts": 4, "moe_intermediate_size": 16,
                                           "shared_expert_intermediate_size": 32})
    transformers.Qwen2MoeForCausalLM(qwen2).save_pretrained(tmp_path / "qwen2")
    with pytest.raises(CheckpointError, match="shared_expert_gate"):
        convert("hf", "trireme", tmp_path / "qwen2", tmp_path / "out")
    make_hf("mixtral", tmp_path / "hf")
    changes = {"sigmoid router": dict(moe_router="sigmoid"),
               "no softmax router": dict(moe_router="softmax"),
               "routing weight scale": dict(moe_score_scale=2.5),
               "shared expert": dict(moe_shared_ffn_hidden_size=16),
               "no place for: layers.1.moe.expert_bias": dict(moe_bias_update_rate=0.1)}
    for i, (message, change) in enumerate(changes.items()):
        conv = read_hf(tmp_path / "hf")
        for key, value in change.items():
            setattr(conv.model, key, value)
        if conv.model.moe_shared_ffn_hidden_size:
            conv.state.update(expected_state(conv.model, "shared"))
        conv.state["layers.1.moe.expert_bias"][0] = 0.5  # learned by loss-free balancing
        with pytest.raises(CheckpointError, match=message):
            write_hf(conv, tmp_path / f"out{i}", torch.float32)
        assert not (tmp_path / f"out{i}").exists()


def expected_state(cfg: ModelConfig, part: str) -> dict[str, torch.Tensor]:
    """Random tensors for the names of `GPT(cfg)`'s state that hold `part`."""
    return {n: torch.randn(shape) for n, shape in expected_shapes(cfg).items() if part in n}


# --------------------------------------------------------------------------------------------
# Full-size presets: parameters (total and active) and the FLOPs MFU counts

PUBLISHED = {  # preset: (total, active) parameters, published; deepseek-v3: its stand-in's
    "mixtral-8x7b": (46.7e9, 12.9e9),
    "qwen3-30b-a3b": (30.5e9, 3.3e9),
    "deepseek-v3": (674.8e9, 41.4e9),  # MLA replaced by GQA: the real model has 671B / 37B
}


def parameter_counts(cfg: ModelConfig) -> tuple[int, int, int]:
    """(total, active per token, active in matmuls) parameters of GPT(cfg), built on the meta
    device: active leaves out each MoE sublayer's idle experts, the matmul count also the
    input embedding and the norms (what the FLOPs formula multiplies)."""
    with torch.device("meta"):
        params = dict(GPT(cfg, seed=None).named_parameters())
    total = sum(p.numel() for p in params.values())
    expert = 3 * cfg.hidden_size * cfg.moe_ffn_size
    idle = sum((cfg.moe_num_experts - cfg.moe_top_k) * expert
               for layer in cfg.layer_symbols if "E" in layer)
    unmultiplied = sum(p.numel() for n, p in params.items()
                       if p.dim() == 1 or n == "embedding.weight")
    return total, total - idle, total - idle - unmultiplied


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_full_presets_have_the_published_size(name: str) -> None:
    cfg = load_config(name).model
    total, active, matmul = parameter_counts(cfg)
    assert total == pytest.approx(PUBLISHED[name][0], rel=0.005)
    assert active == pytest.approx(PUBLISHED[name][1], rel=0.02)  # Qwen rounds 3.35B to 3.3B
    # MFU counts the active experts only: forward + backward = 6 x the active matmul weights
    # (router and shared expert included), plus the attention scores (q * s per * sublayer)
    scores = 6 * sum(cfg.num_attention_heads * cfg.head_size * cfg.seq_length
                     for layer in cfg.layer_symbols)
    assert flops_per_token(cfg) == pytest.approx(6 * matmul + scores, rel=1e-9)
