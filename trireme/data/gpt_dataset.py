"""Fixed-length training samples cut from a stream of documents, in an order set by a seed.

One epoch: shuffle the chosen documents, concatenate them into one token stream, and cut it into
samples of `seq_length + 1` tokens, where sample k covers stream tokens [k*s, (k+1)*s] (so
consecutive samples share one token, as in Megatron: the last label of one is the first input of
the next). The samples of the epoch are then visited in a shuffled order. Tokens left over at the
end of an epoch (fewer than a sample) are dropped. Epoch e uses a fresh shuffle seeded by (seed, e),
so sample i of the endless dataset depends only on (seed, i) and a resumed run continues the order.

Each epoch has three index arrays, built with numpy only (no Python loop over documents or tokens)
and cached as `.npy` (see cache.py) under a hash of everything they depend on:
    document_index  the epoch's documents, in shuffled order
    sample_index    where each of the epoch's sequences starts in its token stream (sample k
                    starts at stream token k * seq_length)
    shuffle_index   the order in which the epoch's samples are visited
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trireme.data.batch import (  # noqa: F401 (BatchIterator, get_batch: re-exported)
    DEFAULT_OPTIONS,
    BatchIterator,
    BatchOptions,
    get_batch,
)
from trireme.data.cache import array_digest, dataset_fingerprint, load_or_build
from trireme.data.indexed import IndexedDataset
from trireme.errors import ConfigError, DataError
from trireme.words import count_of

INDEX_VERSION = 1  # bump when the meaning of the index arrays changes


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """Independent streams per (seed, epoch): 0 shuffles documents, 1 shuffles samples."""
    return np.random.default_rng(np.random.SeedSequence([seed % 2**64, epoch, stream]))


def _smallest_int(array: np.ndarray) -> np.ndarray:
    """int32 when the values fit (half the cache size), else int64."""
    if array.size == 0 or array.max() < 2**31:
        return array.astype(np.int32)
    return array.astype(np.int64)


class _Epoch:
    """The index arrays of one epoch, and the per-sequence lookups derived from them."""

    def __init__(self, data: GPTDataset, epoch: int) -> None:
        ds = data.dataset
        arrays = load_or_build(data.cache_dir, data.cache_description(epoch),
                               lambda: data.build_epoch(epoch))
        documents = np.asarray(arrays["document_index"], dtype=np.int64)
        self.sample_index = np.asarray(arrays["sample_index"], dtype=np.int64)
        self.shuffle_index = np.asarray(arrays["shuffle_index"], dtype=np.int64)
        self.sequence_ids = _sequences_of(ds, documents)
        # where each sequence begins in .bin, in tokens
        self.element_offsets = ds.sequence_pointers[self.sequence_ids] // ds.dtype.itemsize


def _sequences_of(ds: IndexedDataset, documents: np.ndarray) -> np.ndarray:
    """The sequence ids of `documents`, in order (one each unless the data was sentence-split)."""
    first = ds.document_indices[documents]
    counts = ds.document_indices[documents + 1] - first
    run_starts = np.cumsum(counts) - counts
    return np.repeat(first - run_starts, counts) + np.arange(int(counts.sum()))


class GPTDataset(torch.utils.data.Dataset):
    """Endless samples of `seq_length + 1` tokens from the chosen documents of an IndexedDataset.

    `dataset[i]` for any i >= 0 is an int64 array; epoch `i // samples_per_epoch` has its own
    document and sample order, deterministic in (seed, epoch). `cache_dir` (None: no disk cache)
    is where the epochs' index arrays are kept; `options` go to the batches (see batch.py).
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        seq_length: int,
        seed: int,
        document_ids: np.ndarray | None = None,
        *,
        cache_dir: str | Path | None = None,
        options: BatchOptions = DEFAULT_OPTIONS,
        name: str = "",
    ) -> None:
        if seq_length < 1:
            raise ConfigError(f"model.seq_length = {seq_length} must be at least 1")
        self.dataset = dataset
        self.seq_length = seq_length
        self.seed = seed
        self.cache_dir = Path(cache_dir) if cache_dir else None
        self.options = options
        self.name = name or Path(dataset.prefix).name
        if document_ids is None:
            document_ids = np.arange(dataset.num_documents, dtype=np.int64)
        self.document_ids = np.asarray(document_ids, dtype=np.int64)
        if self.document_ids.size and (
            self.document_ids.min() < 0 or self.document_ids.max() >= dataset.num_documents
        ):
            raise ValueError(f"document ids out of range for {dataset.num_documents} documents")
        # tokens before each sequence, indexed by the document boundaries
        tokens_before = np.concatenate([[0], np.cumsum(dataset.sequence_lengths, dtype=np.int64)])
        first = tokens_before[dataset.document_indices[self.document_ids]]
        last = tokens_before[dataset.document_indices[self.document_ids + 1]]
        self.tokens_per_epoch = int((last - first).sum())
        self.samples_per_epoch = max(self.tokens_per_epoch - 1, 0) // seq_length
        if self.samples_per_epoch == 0:
            raise DataError(
                f"data.path {dataset.prefix!r}: {count_of(self.document_ids.size, 'document')} "
                f"chosen, with {count_of(self.tokens_per_epoch, 'token')}: fewer than one sample "
                f"of seq_length + 1 = {seq_length + 1}; use more data or a shorter model.seq_length"
            )
        self._fingerprint: str | None = None
        self._epochs: dict[int, _Epoch] = {}

    def cache_description(self, epoch: int) -> dict:
        """Everything epoch `epoch`'s index arrays depend on (hashed into the cache key)."""
        if self._fingerprint is None:
            self._fingerprint = dataset_fingerprint(self.dataset)
        return {
            "kind": f"gpt-{self.name}"[:60],
            "index_version": INDEX_VERSION,
            "dataset": self._fingerprint,
            "documents": array_digest(self.document_ids),
            "num_documents": int(self.document_ids.size),
            "seq_length": self.seq_length,
            "seed": self.seed,
            "epoch": epoch,
        }

    def build_epoch(self, epoch: int) -> dict[str, np.ndarray]:
        """The three index arrays of one epoch (numpy only: a permutation, gathers, a cumsum)."""
        documents = _rng(self.seed, epoch, 0).permutation(self.document_ids)
        sequences = _sequences_of(self.dataset, documents)
        lengths = self.dataset.sequence_lengths[sequences].astype(np.int64)
        starts = np.cumsum(lengths) - lengths
        order = _rng(self.seed, epoch, 1).permutation(self.samples_per_epoch)
        return {
            "document_index": _smallest_int(documents),
            "sample_index": starts,
            "shuffle_index": _smallest_int(order),
        }

    def _epoch(self, epoch: int) -> _Epoch:
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # a batch spans at most two epochs; keep the recent ones
                del self._epochs[min(self._epochs)]
            self._epochs[epoch] = _Epoch(self, epoch)
        return self._epochs[epoch]

    def get_samples(self, indices: np.ndarray | list[int]) -> np.ndarray:
        """Samples at `indices` (each >= 0), as int64[len(indices), seq_length + 1]."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and indices.min() < 0:
            raise IndexError(f"sample index {int(indices.min())} is negative")
        out = np.empty((indices.size, self.seq_length + 1), dtype=np.int64)
        epochs = indices // self.samples_per_epoch
        for epoch in np.unique(epochs):  # one or two epochs per batch
            rows = np.nonzero(epochs == epoch)[0]
            ep = self._epoch(int(epoch))
            k = ep.shuffle_index[indices[rows] % self.samples_per_epoch]
            # positions in the epoch's stream: [b, s + 1]
            pos = k[:, None] * self.seq_length + np.arange(self.seq_length + 1)
            seg = np.searchsorted(ep.sample_index, pos, side="right") - 1
            flat = ep.element_offsets[seg] + (pos - ep.sample_index[seg])
            out[rows] = self.dataset.tokens[flat]
        return out

    def __len__(self) -> int:
        return self.samples_per_epoch

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get_samples([i])[0]


def split_documents(
    num_documents: int, split: str = "969,30,1"
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Contiguous train / valid / test ranges of document ids, sized by the split weights.

    Sizes are rounded by largest remainder so they sum to `num_documents`; a share with a positive
    weight gets at least one document when there are enough documents to go round.
    """
    try:
        weights = np.array([float(w) for w in split.split(",")], dtype=np.float64)
    except ValueError:
        weights = np.array([])
    if not 1 <= weights.size <= 3 or np.any(weights < 0) or weights.sum() <= 0:
        raise ConfigError(
            f"data.split = {split!r} must be up to three non-negative weights like '969,30,1'"
        )
    weights = np.pad(weights, (0, 3 - weights.size)) / weights.sum()
    raw = weights * num_documents
    counts = np.floor(raw).astype(np.int64)
    remainder = num_documents - int(counts.sum())
    counts[np.argsort(-(raw - counts), kind="stable")[:remainder]] += 1
    wanted = weights > 0
    if num_documents >= int(wanted.sum()):
        for share in np.nonzero(wanted & (counts == 0))[0]:
            counts[np.argmax(counts)] -= 1
            counts[share] += 1
    bounds = np.concatenate([[0], np.cumsum(counts)])
    train, valid, test = (np.arange(bounds[j], bounds[j + 1], dtype=np.int64) for j in range(3))
    return train, valid, test
