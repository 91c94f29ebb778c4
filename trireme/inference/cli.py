"""`trireme generate`: load a checkpoint and continue a prompt."""

from __future__ import annotations

import torch

from trireme.checkpoint.model_state import model_from_state
from trireme.checkpoint.store import load_checkpoint
from trireme.checkpoint.tokenizer_copy import tokenizer_for
from trireme.config import config_from_toml
from trireme.data.images import load_image, pixels
from trireme.data.multimodal import image_prompt_ids, image_token_id
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import CheckpointError, ConfigError
from trireme.inference.generate import first_non_finite, generate, printable_ids
from trireme.models.vision import num_image_tokens
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
    image: str = "",
) -> str:
    """Generate a continuation of `prompt` with the model saved in `checkpoint`. With `image`
    (a vision model), the prompt is a question about that image, framed as in training
    (trireme.data.multimodal.image_prompt_ids)."""
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
    ids, images = tok.encode(prompt) or [tok.eod], None
    if image:
        if not cfg.model.vision_layers:
            raise ConfigError(f"--image: the model in {ckpt.path} has no vision encoder "
                              "(model.vision_layers = 0)")
        image_id = cfg.model.image_token_id
        if image_id < 0:
            image_id = image_token_id(tok, tok_spec)
        ids = image_prompt_ids(tok, prompt, image_id, num_image_tokens(cfg.model))
        images = pixels(load_image(image, cfg.model.vision_image_size, "--image: ")[None])
        images = images.to(dev, dtype)
    out = generate(model, ids, max_new_tokens, temperature=temperature, top_k=top_k,
                   top_p=top_p, greedy=greedy, seed=seed, eos_id=tok.eod, images=images)
    out_ids = out[0].tolist() if out.dim() == 2 else out.tolist()
    if image:  # the question and the answer, without the image's placeholder tokens
        out_ids = [i for i in out_ids if i != image_id]
        return tok.decode(printable_ids(out_ids, len(ids) - num_image_tokens(cfg.model),
                                        tok.eod))
    return tok.decode(printable_ids(out_ids, len(ids), tok.eod))
