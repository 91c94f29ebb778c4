"""A mock GPT dataset for benchmarks and tests: no files, endless, deterministic by seed.

Token j of sample i is a hash of (seed, i, j) reduced to the vocabulary, computed for a whole batch
at once with numpy; about one token in `mean_document_length` is the end-of-document id, so the
batch options (eod_mask_loss, reset_position_ids, reset_attention_mask) have work to do.
"""

from __future__ import annotations

import numpy as np
import torch

from trireme.data.batch import DEFAULT_OPTIONS, BatchOptions
from trireme.errors import ConfigError

_MASK = np.uint64(2**64 - 1)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: a fast, well-spread hash of uint64 values."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class MockGPTDataset(torch.utils.data.Dataset):
    """Endless random samples of `seq_length + 1` tokens in [0, vocab_size)."""

    def __init__(
        self,
        vocab_size: int,
        seq_length: int,
        seed: int,
        *,
        options: BatchOptions = DEFAULT_OPTIONS,
        mean_document_length: int = 512,
        name: str = "mock",
    ) -> None:
        if vocab_size < 2 or seq_length < 1:
            raise ConfigError(
                f"mock data needs model.vocab_size >= 2 (got {vocab_size}) and model.seq_length "
                f">= 1 (got {seq_length})"
            )
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.seed = seed
        self.options = options
        self.mean_document_length = mean_document_length
        self.name = name
        self.eod = options.eod if 0 <= options.eod < vocab_size else vocab_size - 1

    def get_samples(self, indices: np.ndarray | list[int]) -> np.ndarray:
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and indices.min() < 0:
            raise IndexError(f"sample index {int(indices.min())} is negative")
        s1 = self.seq_length + 1
        with np.errstate(over="ignore"):
            key = _mix(np.uint64(self.seed % 2**64) + np.uint64(0x9E3779B97F4A7C15))
            counter = indices.astype(np.uint64)[:, None] * np.uint64(s1) + np.arange(
                s1, dtype=np.uint64
            )  # [b, s + 1]
            h = _mix(counter ^ key)
        tokens = (h % np.uint64(self.vocab_size)).astype(np.int64)
        ends = (_mix(h) % np.uint64(self.mean_document_length)) == 0
        tokens[ends] = self.eod
        return tokens

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get_samples([i])[0]
