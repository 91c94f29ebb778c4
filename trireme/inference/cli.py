"""`trireme generate`: load a checkpoint and continue a prompt."""

from __future__ import annotations

import torch

from trireme.checkpoint.model_state import model_from_state
from trireme.checkpoint.store import load_checkpoint
from trireme.checkpoint.tokenizer_copy import tokenizer_for
from trireme.config import config_from_toml
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import CheckpointError
from trireme.inference.generate import first_non_finite, generate, printable_ids
from trireme.trainer import DTYPES, pick_device


def generate_from_checkpoint(
    checkpoint: str,
    prompt: str,
    *,
    max_new_tokens: int = 100,
    temperature: float = 0.8,
    top_k: int = 0,
    top_p: float = 1.0,
    greedy: bool = False,
    seed: int | None = None,
    tokenizer: str = "",
    device: str = "auto",
) -> str:
    """Generate a continuation of `prompt` with the model saved in `checkpoint`."""
    ckpt = load_checkpoint(checkpoint, name="--checkpoint")
    cfg = config_from_toml(ckpt.config_toml, f"{ckpt.path}/config.toml")
    tok_spec = tokenizer_for(ckpt.path, cfg.data.tokenizer, tokenizer)
    tok = load_tokenizer(tok_spec, name="--tokenizer" if tokenizer else "data.tokenizer")
    dev = pick_device(device)
    dtype = DTYPES[cfg.model.precision]
    if dev.type == "cpu" and dtype == torch.float16:
        dtype = torch.float32  # fp16 matmuls are slow or missing on CPU
    # built on the meta device and filled from the checkpoint: no random init, no CPU copy
    model = model_from_state(cfg.model, ckpt.model, dev, dtype).eval()
    bad = first_non_finite(model)
    if bad is not None:
        raise CheckpointError(f"checkpoint {ckpt.path} holds non-finite weights ({bad!r} has a "
                              "NaN or inf): the run diverged before it was saved; use an "
                              "earlier checkpoint")
    ids = tok.encode(prompt) or [tok.eod]
    out = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, greedy=greedy, seed=seed, eos_id=tok.eod)
    out_ids = out[0].tolist() if out.dim() == 2 else out.tolist()
    return tok.decode(printable_ids(out_ids, len(ids), tok.eod))
