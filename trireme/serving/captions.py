"""How well a vision-language model trained on the shapes corpus describes new images.

`caption_accuracy` draws `count` images with a seed the corpus never used (trireme.data.shapes),
asks the model the training question with greedy decoding, and scores each caption: the share
naming the right colour (chance 1/6) and the right shape (chance 1/3), and naming only one of each.
"""

from __future__ import annotations

import numpy as np
import torch

from trireme.data.images import pixels
from trireme.data.multimodal import image_prompt_ids
from trireme.data.shapes import QUESTION, caption_words, draw_sample
from trireme.data.tokenizer_base import Tokenizer
from trireme.models.gpt import GPT
from trireme.models.vision import num_image_tokens
from trireme.serving.generate import generate


@torch.no_grad()
def caption_accuracy(model: GPT, tokenizer: Tokenizer, count: int = 64, seed: int = 99,
                     max_new_tokens: int = 10) -> dict[str, float]:
    """{"colour": share right, "shape": share right} over `count` held-out images."""
    cfg = model.cfg
    rng = np.random.default_rng(seed)
    samples = [draw_sample(rng, cfg.vision_image_size) for _ in range(count)]
    device = model.embedding.weight.device
    images = pixels(np.stack([image for image, _ in samples])).to(device)
    prompt = image_prompt_ids(tokenizer, QUESTION, cfg.image_token_id, num_image_tokens(cfg))
    ids = torch.tensor([prompt] * count)  # the same prompt, each with its own image
    out = generate(model, ids, max_new_tokens, greedy=True, eos_id=tokenizer.eod, images=images)
    right = {"colour": 0, "shape": 0}
    for row, (_, attributes) in zip(out[:, len(prompt):].tolist(), samples):
        text = tokenizer.decode([t for t in row if t != tokenizer.eod])
        for key, ok in caption_words(text, attributes).items():
            right[key] += ok
    return {key: n / count for key, n in right.items()}
