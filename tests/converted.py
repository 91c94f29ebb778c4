"""A trireme checkpoint (as `trireme convert` writes it) loaded as a model, for interop tests."""

from __future__ import annotations

from pathlib import Path

from trireme.checkpoint.store import load_checkpoint, load_model_state
from trireme.config import config_from_toml
from trireme.models.gpt import GPT


def trireme_model(path: Path) -> GPT:
    """The model saved at `path`, in eval mode."""
    ckpt = load_checkpoint(path)
    model = GPT(config_from_toml(ckpt.config_toml).model, seed=None)
    load_model_state(model, ckpt.model)
    return model.eval()
