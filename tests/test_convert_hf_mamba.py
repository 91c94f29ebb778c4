"""Mamba-2 and Nemotron-H to and from Hugging Face (`Mamba2ForCausalLM`, `NemotronHForCausalLM`):
tiny random transformers models built here (no download), fp32 on CPU, through transformers' torch
path (no kernels installed), give the same logits in trireme, come back identical, and continue a
prompt with the same greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.converted import assert_exports_back, assert_generate_matches_hf, trireme_model
from trireme.checkpoint.store import load_checkpoint
from trireme.cli import main
from trireme.config import config_from_toml
from trireme.convert.convert import convert, read_trireme, write_trireme
from trireme.convert.converted import Converted
from trireme.convert.hf import write_hf
from trireme.errors import CheckpointError

transformers = pytest.importorskip("transformers")

VOCAB = 100
HF_MODELS = {  # name: Mamba2Config keywords
    "groups-2": dict(num_heads=8, head_dim=8, n_groups=2, chunk_size=8),
    "one-group-tied-limited": dict(num_heads=4, head_dim=16, n_groups=1, chunk_size=16,
                                   tie_word_embeddings=True, use_conv_bias=False,
                                   time_step_limit=(0.01, 0.5)),
}


NEMOTRON_H = dict(  # M - * - M M -: the pattern "M-*-MM-"
    layers_block_type=["linear_attention", "mlp", "full_attention", "mlp", "linear_attention",
                       "linear_attention", "mlp"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=48,
    mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8, n_groups=2, chunk_size=8,
    max_position_embeddings=64, time_step_min=0.01)


def make_hf(name: str, folder: Path, dt_bias: tuple[float, float] = (-3.0, 0.5),
            **nemotron_h: object) -> torch.nn.Module:
    common = dict(vocab_size=VOCAB, hidden_size=32, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if name == "nemotron-h":
        config = transformers.NemotronHConfig(**common, **{**NEMOTRON_H, **nemotron_h})
        model_class = transformers.NemotronHForCausalLM
    else:
        config = transformers.Mamba2Config(**common, num_hidden_layers=3, state_size=8,
                                           expand=2, conv_kernel=4, **HF_MODELS[name])
        model_class = transformers.Mamba2ForCausalLM
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # everything away from its trivial init (D = 1, norms = 1, ...)
        for n, p in model.named_parameters():
            if n.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif n.endswith("dt_bias"):
                p.uniform_(*dt_bias)
            else:
                p.normal_(0.5, 0.2) if p.dim() == 1 else p.normal_(0.0, 0.2)
    model.save_pretrained(folder)
    return model


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float = 1e-4) -> None:
    assert got.shape == want.shape
    diff = (got - want).abs().max().item()
    assert diff <= tol * max(1.0, want.abs().max().item()), f"max |diff| {diff}"


@pytest.mark.parametrize("name", [*HF_MODELS, "nemotron-h"])
def test_hf_mamba2_and_nemotron_h_both_ways_same_logits(tmp_path: Path, capsys,
                                                        name: str) -> None:
    hf = make_hf(name, tmp_path / "hf")
    assert main(["inspect", str(tmp_path / "hf")]) == 0
    heads = getattr(hf.config, "num_heads", None) or hf.config.mamba_num_heads
    summary = capsys.readouterr().out
    assert f"3 Mamba-2 layers ({heads} heads x " in summary
    if name != "nemotron-h":  # no attention, no MLP: neither heads, positions nor ffn named
        assert not any(word in summary for word in ("heads (head", "rope", "ffn"))
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    assert want.std() > 0.1
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    model = trireme_model(tmp_path / "tri")
    assert model.cfg.layer_pattern == ("M-*-MM-" if name == "nemotron-h" else "MMM")
    assert model.cfg.mamba_num_groups == hf.config.n_groups
    with torch.no_grad():
        assert_close(model(ids), want)

    assert_exports_back(tmp_path, hf, ids, want, assert_close)


def test_nemotron_h_without_conv_bias_keeps_dt_bias(tmp_path: Path) -> None:
    """use_conv_bias = false dropped every name with "bias" in it from the table, dt_bias too:
    the folder was refused ('unexpected: ...mixer.dt_bias'), such a trireme hybrid unexported."""
    hf = make_hf("nemotron-h", tmp_path / "hf", use_conv_bias=False)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    model = trireme_model(tmp_path / "tri")
    assert not model.cfg.mamba_conv_bias
    with torch.no_grad():
        assert_close(model(ids), want)
    assert_exports_back(tmp_path, hf, ids, want, assert_close)


@pytest.mark.parametrize("limit", [None, (0.004, 0.5)])
def test_nemotron_h_clamps_dt_to_time_step_limit_not_time_step_min(tmp_path: Path,
                                                                   limit: tuple | None) -> None:
    """transformers' Nemotron-H mixer clamps dt to time_step_limit ((0, inf) unless set), as
    Mamba-2's does; time_step_min only draws dt_bias's init. Here most steps are below it."""
    extra = {} if limit is None else {"time_step_limit": limit}
    hf = make_hf("nemotron-h", tmp_path / "hf", dt_bias=(-8.0, -4.0), **extra)
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    model = trireme_model(tmp_path / "tri")
    with torch.no_grad():
        assert_close(model(ids), want)
    assert (model.cfg.mamba_dt_limit_min, model.cfg.mamba_dt_limit_max) == (limit or (0.0, 0.0))
    assert_exports_back(tmp_path, hf, ids, want, assert_close)


def test_tied_hybrid_exports_to_nemotron_h_with_its_head_and_reads_back_tied(
        tmp_path: Path) -> None:
    """NemotronHForCausalLM never ties lm_head to the embedding: a tied trireme hybrid is written
    with lm_head.weight (a copy) and tie_word_embeddings false, not left to a random init."""
    make_hf("nemotron-h", tmp_path / "hf")
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "untied")
    conv = read_trireme(tmp_path / "untied")
    conv.model.tie_embeddings = True
    del conv.state["output.weight"]
    write_trireme(conv, tmp_path / "tri", torch.float32)
    model = trireme_model(tmp_path / "tri")
    ids = torch.randint(0, VOCAB, (2, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model(ids)
    assert want.std() > 0.1

    convert("trireme", "hf", tmp_path / "tri", tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "nemotron_h" and config["tie_word_embeddings"] is False
    hf, info = transformers.NemotronHForCausalLM.from_pretrained(
        tmp_path / "back", dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        assert_close(hf.eval()(ids).logits, want)
        assert torch.equal(hf.lm_head.weight, hf.get_input_embeddings().weight)

    convert("hf", "trireme", tmp_path / "back", tmp_path / "again")  # equal tensors: tied again
    again = trireme_model(tmp_path / "again")
    assert again.cfg.tie_embeddings
    ours, theirs = model.state_dict(), again.state_dict()
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    with torch.no_grad():
        assert torch.equal(again(ids), want)


@pytest.mark.parametrize("name", ["groups-2", "nemotron-h"])
def test_trireme_generate_greedy_continues_as_hf(tmp_path: Path, capsys, name: str) -> None:
    hf = make_hf(name, tmp_path / "hf")
    prompt = [5, 17, 42, 3, 61, 8, 9, 10, 11]  # longer than a chunk: prefill in two chunks
    assert_generate_matches_hf(tmp_path, hf, prompt, VOCAB - 1, capsys)


def test_models_no_hugging_face_family_holds_are_one_line_errors(tmp_path: Path) -> None:
    make_hf("groups-2", tmp_path / "hf")
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    cfg = config_from_toml(load_checkpoint(tmp_path / "tri").config_toml).model
    cfg.layer_pattern, cfg.num_layers = "M-M-M-", 3  # a hybrid: Nemotron-H's shape, but SwiGLU
    with pytest.raises(CheckpointError, match="NemotronHForCausalLM .* has no activation = "
                       "'swiglu'") as err:
        write_hf(Converted(model=cfg, state={}, source="test"), tmp_path / "out", torch.float32)
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
