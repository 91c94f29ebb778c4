"""A served request's images: their features, handed to the prompt chunks that hold them.

`trireme generate --image` runs the whole prompt at once and the model merges the image features
into its placeholder positions (trireme.models.vision). The engine prefills a prompt in chunks
packed with other requests' tokens, so each request keeps

    positions  [m]      the prompt positions of its image placeholder tokens (m = images x n)
    features   [m, h]   their projected features, computed on the request's first chunk

and a chunk covering prompt positions start..start+count-1 gets the rows of the placeholders it
holds (`chunk`). Decode steps never see images (as in `generate`), so CUDA graphs are untouched.
"""

from __future__ import annotations

import bisect

import torch

from trireme.models.gpt import GPT


class RequestImages:
    """Pixels [k, 3, S, S] of one request and the prompt positions of their placeholders."""

    def __init__(self, pixels: torch.Tensor, positions: list[int]) -> None:
        self.pixels: torch.Tensor | None = pixels
        self.positions = positions  # ascending
        self.features: torch.Tensor | None = None  # [m, h] once encoded

    def chunk(self, model: GPT, start: int, count: int) -> tuple[list[int], torch.Tensor]:
        """(offsets in the chunk [j], features [j, h]) of the placeholders at prompt positions
        start..start+count-1; the images are encoded on the first call."""
        if self.features is None:
            weight = model.embedding.weight
            pixels = self.pixels.to(weight.device, weight.dtype)
            self.features = model.image_features(pixels).flatten(0, 1)  # [k n, h]
            self.pixels = None
        first = bisect.bisect_left(self.positions, start)
        last = bisect.bisect_left(self.positions, start + count)
        return [p - start for p in self.positions[first:last]], self.features[first:last]
