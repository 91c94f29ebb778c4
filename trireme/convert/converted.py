"""The model on its way between formats (`Converted`); the file helpers every converter uses are
trireme.checkpoint.files.

Every reader (Hugging Face, Megatron, trireme) produces a `Converted` and every writer takes one
(convert.py pairs them); the checks of a state against its config are model_state.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from trireme.config import ModelConfig
from trireme.errors import CheckpointError


@dataclass
class Converted:
    """A model on its way between formats: config and state in trireme's names and layouts."""

    model: ModelConfig
    state: dict[str, Tensor]
    source: str  # what it was read from, e.g. "hf llama" or "megatron legacy TP=2 PP=1"
    step: int = 0
    consumed_samples: int = 0
    notes: list[str] = field(default_factory=list)  # what the user should know (approximations)
    tokenizer_dir: Path | None = None  # a folder holding TOKENIZER_FILES to carry along
    tokenizer_spec: str = ""  # a trireme source's data.tokenizer, kept where nothing is copied

    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.state.values())


def cast_state(state: dict[str, Tensor], dtype: torch.dtype | None) -> dict[str, Tensor]:
    """Floating tensors cast to `dtype` (None: unchanged), all contiguous on CPU. A finite value
    that becomes Inf (past fp16's 65504) is a CheckpointError, not a damaged output."""
    out = {}
    for name, t in state.items():
        if dtype is not None and t.is_floating_point() and t.dtype != dtype:
            cast = t.to(dtype)
            if not torch.isfinite(cast).all() and torch.isfinite(t).all():
                raise CheckpointError(
                    f"{name} holds values beyond {str(dtype).removeprefix('torch.')}'s range "
                    f"(largest magnitude {t.abs().max().item():.4g}); convert with another "
                    "--dtype (bf16 or fp32)")
            t = cast
        out[name] = t.detach().to("cpu").contiguous()
    return out
