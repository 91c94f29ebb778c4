"""Hugging Face LlavaForConditionalGeneration (CLIP + Llama) <-> trireme's vision GPT: the same
logits (fp32, 1e-4) for the same image and prompt, both ways."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_convert import assert_close, trireme_logits_of

from trireme.cli import main
from trireme.convert.convert import convert
from trireme.errors import CheckpointError

transformers = pytest.importorskip("transformers")
VOCAB, IMAGE = 60, 59


def make_llava(folder: Path, select: str, layer: int, act: str) -> torch.nn.Module:
    vision = transformers.CLIPVisionConfig(
        hidden_size=24, intermediate_size=40, num_hidden_layers=3, num_attention_heads=2,
        image_size=16, patch_size=4, hidden_act=act)
    text = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg = transformers.LlavaConfig(vision_config=vision, text_config=text,
                                   image_token_index=IMAGE, vision_feature_layer=layer,
                                   vision_feature_select_strategy=select)
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # norms, biases and embeddings away from their trivial init
        for name, p in model.named_parameters():
            p.normal_(0.3 if p.dim() == 1 and name.endswith("weight") else 0.0,
                      0.2 if p.dim() == 1 else 0.1)
    model.save_pretrained(folder)
    return model


def inputs(select: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = 16 + (select == "full")
    gen = torch.Generator().manual_seed(1)
    text = torch.randint(0, IMAGE, (2, 12), generator=gen)
    ids = torch.cat([text[:, :3], torch.full((2, n), IMAGE), text[:, 3:]], 1)
    return ids, torch.randn(2, 3, 16, 16, generator=gen)


@pytest.mark.parametrize("select, layer, act", [("default", -2, "quick_gelu"),
                                                ("full", 1, "gelu")])
def test_llava_round_trip(tmp_path: Path, select: str, layer: int, act: str) -> None:
    hf = make_llava(tmp_path / "hf", select, layer, act)
    ids, images = inputs(select)
    with torch.no_grad():
        want = hf(input_ids=ids, pixel_values=images).logits
    assert want.std() > 0.1
    conv, _ = convert("hf", "trireme", tmp_path / "hf", tmp_path / "trireme")
    assert conv.model.vision_feature_layer == layer
    assert_close(trireme_logits_of(tmp_path / "trireme", ids, images=images), want)

    convert("trireme", "hf", tmp_path / "trireme", tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert config["model_type"] == "llava" and config["vision_feature_layer"] == -1
    back = transformers.LlavaForConditionalGeneration.from_pretrained(
        tmp_path / "back", dtype=torch.float32).eval()
    with torch.no_grad():
        assert_close(back(input_ids=ids, pixel_values=images).logits, want)


def test_llava_with_other_vision_tower_is_a_one_line_error(tmp_path: Path) -> None:
    make_llava(tmp_path / "hf", "default", -2, "quick_gelu")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["vision_config"]["model_type"] = "siglip_vision_model"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="vision tower 'siglip_vision_model'"):
        convert("hf", "trireme", tmp_path / "hf", tmp_path / "trireme")


def test_inspect_names_the_vision_encoder(tmp_path: Path, capsys) -> None:
    """inspect of a LLaVA folder, and of its conversion, described the language model alone."""
    make_llava(tmp_path / "hf", "default", -2, "quick_gelu")
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "trireme")
    for path in ("hf", "trireme"):
        assert main(["inspect", str(tmp_path / path)]) == 0
        assert ("vision encoder (3 layers, hidden 24, 16px images in 4px patches)"
                in capsys.readouterr().out)
