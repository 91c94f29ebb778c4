"""The decoding state of a whole model: what each layer's sublayers keep between steps (keys and
values for attention), preallocated for `max_len` positions and asked of the sublayers themselves
(`Block.new_cache`), so a layer pattern with other mixers needs nothing here."""

from __future__ import annotations

from typing import Any

from torch import nn


class InferenceCache:
    """Layer i's state is `cache[i]`, a dict sublayer name -> state (attention: (k, v) buffers,
    [b, n_kv, max_len, d]). Attention writes positions start_pos..start_pos+s-1 and reads
    0..start_pos+s-1; a batch smaller than the cache's uses its first rows."""

    def __init__(self, layers: dict[int, dict[str, Any]], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: nn.Module, batch_size: int, max_len: int | None = None
                  ) -> InferenceCache:
        """A cache shaped for `model` (a GPT), on its device and in its parameters' dtype."""
        max_len = max_len or model.cfg.seq_length
        weight = model.embedding.weight
        layers = {int(name): block.new_cache(batch_size, max_len, weight.device, weight.dtype)
                  for name, block in model.layers.items()}
        return cls(layers, max_len)

    def __getitem__(self, layer: int) -> dict[str, Any]:
        return self.layers[layer]

    def __len__(self) -> int:
        return len(self.layers)
