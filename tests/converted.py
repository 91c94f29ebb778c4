"""Interop-test helpers: a trireme checkpoint (as `trireme convert` writes it) loaded as a model,
the export back to Hugging Face checked against the original, and `trireme generate --greedy`
checked against HF's greedy generate."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from trireme.checkpoint.store import load_checkpoint, load_model_state
from trireme.cli import main
from trireme.config import config_from_toml
from trireme.convert.convert import convert
from trireme.models.gpt import GPT


def trireme_model(path: Path) -> GPT:
    """The model saved at `path`, in eval mode."""
    ckpt = load_checkpoint(path)
    model = GPT(config_from_toml(ckpt.config_toml).model, seed=None)
    load_model_state(model, ckpt.model)
    return model.eval()


def assert_exports_back(tmp_path: Path, hf, ids: torch.Tensor, want: torch.Tensor,
                        close: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    """tmp_path/tri exported to HF (tmp_path/back): the same model_type, logits `close` to
    `want` for `ids`, and the very tensors, under the names transformers saves, of tmp_path/hf."""
    convert("trireme", "hf", tmp_path / "tri", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["model_type"] == (
        hf.config.model_type)
    back = type(hf).from_pretrained(tmp_path / "back", dtype=torch.float32)
    with torch.no_grad():
        close(back.eval()(ids).logits, want)
    with (safe_open(tmp_path / "hf" / "model.safetensors", "pt") as a,
          safe_open(tmp_path / "back" / "model.safetensors", "pt") as b):
        assert sorted(a.keys()) == sorted(b.keys())  # the on-disk names transformers saves
        assert all(torch.equal(a.get_tensor(n), b.get_tensor(n)) for n in a.keys())


def assert_generate_matches_hf(tmp_path: Path, hf, prompt: list[int], eod: int, capsys) -> None:
    """`trireme generate --greedy` of tmp_path/hf converted gives HF's greedy tokens (the null
    tokenizer: the text is the ids, its end of document `eod`)."""
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                       eos_token_id=eod, pad_token_id=eod)[0].tolist()
    assert main(["generate", "--checkpoint", str(tmp_path / "tri"), "--prompt",
                 " ".join(map(str, prompt)), "--max-new-tokens", "12", "--greedy",
                 "--tokenizer", f"null:{eod}", "--device", "cpu"]) == 0
    got = [int(t) for t in capsys.readouterr().out.split()]
    assert got == want[: len(got)] and len(got) > len(prompt)
