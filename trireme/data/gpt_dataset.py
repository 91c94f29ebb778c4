"""Fixed-length training samples cut from a stream of documents, in an order set by a seed.

One epoch: shuffle the chosen documents, concatenate them into one token stream, and cut it into
samples of `seq_length + 1` tokens, where sample k covers stream tokens [k*s, (k+1)*s] (so
consecutive samples share one token, as in Megatron: the last label of one is the first input of
the next). The samples of the epoch are then visited in a shuffled order. Tokens left over at the
end of an epoch (fewer than a sample) are dropped. Epoch e uses a fresh shuffle seeded by (seed, e),
so sample i of the endless dataset depends only on (seed, i) and a resumed run continues the order.
"""

from __future__ import annotations

import numpy as np
import torch

from trireme.data.indexed import IndexedDataset
from trireme.errors import ConfigError, DataError


def _rng(seed: int, epoch: int, stream: int) -> np.random.Generator:
    """Independent streams per (seed, epoch): 0 shuffles documents, 1 shuffles samples."""
    return np.random.default_rng(np.random.SeedSequence([seed % 2**64, epoch, stream]))


class _Epoch:
    """The index arrays of one epoch, built with numpy only (no loop over documents or tokens)."""

    def __init__(self, data: GPTDataset, epoch: int) -> None:
        ds = data.dataset
        docs = _rng(data.seed, epoch, 0).permutation(data.document_ids)
        # Documents -> their sequences, in order (one each unless the data was sentence-split).
        first = ds.document_indices[docs]
        counts = ds.document_indices[docs + 1] - first
        total = int(counts.sum())
        run_starts = np.cumsum(counts) - counts
        self.sequence_ids = np.repeat(first - run_starts, counts) + np.arange(total)
        lengths = ds.sequence_lengths[self.sequence_ids].astype(np.int64)
        # where each sequence begins: in the epoch's token stream, and in .bin (in tokens)
        self.starts = np.cumsum(lengths) - lengths
        self.element_offsets = ds.sequence_pointers[self.sequence_ids] // ds.dtype.itemsize
        self.sample_order = _rng(data.seed, epoch, 1).permutation(data.samples_per_epoch)


class GPTDataset(torch.utils.data.Dataset):
    """Endless samples of `seq_length + 1` tokens from the chosen documents of an IndexedDataset.

    `dataset[i]` for any i >= 0 is an int64 array; epoch `i // samples_per_epoch` has its own
    document and sample order, deterministic in (seed, epoch).
    """

    def __init__(
        self,
        dataset: IndexedDataset,
        seq_length: int,
        seed: int,
        document_ids: np.ndarray | None = None,
    ) -> None:
        if seq_length < 1:
            raise ConfigError(f"model.seq_length = {seq_length} must be at least 1")
        self.dataset = dataset
        self.seq_length = seq_length
        self.seed = seed
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
                f"data.path {dataset.prefix!r}: the {self.document_ids.size} documents chosen hold "
                f"{self.tokens_per_epoch} tokens, fewer than one sample of seq_length + 1 = "
                f"{seq_length + 1}; use more data or a shorter model.seq_length"
            )
        self._epochs: dict[int, _Epoch] = {}

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
            k = ep.sample_order[indices[rows] % self.samples_per_epoch]
            # positions in the epoch's stream: [b, s + 1]
            pos = k[:, None] * self.seq_length + np.arange(self.seq_length + 1)
            seg = np.searchsorted(ep.starts, pos, side="right") - 1
            flat = ep.element_offsets[seg] + (pos - ep.starts[seg])
            out[rows] = self.dataset.tokens[flat]
        return out

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


def get_batch(
    dataset: GPTDataset, consumed_samples: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples `consumed_samples .. consumed_samples + batch_size - 1` as (tokens, labels).

    Both are int64 [batch_size, seq_length]; labels are the tokens shifted left by one. The result
    depends only on the dataset's seed and `consumed_samples`, so resuming continues the order.
    """
    samples = dataset.get_samples(np.arange(consumed_samples, consumed_samples + batch_size))
    samples_t = torch.from_numpy(samples)  # [b, s + 1]
    return samples_t[:, :-1].contiguous(), samples_t[:, 1:].contiguous()


class BatchIterator:
    """Endless (tokens, labels) batches from a GPTDataset, starting after `consumed_samples`.

    `consumed_samples` advances by `batch_size` per batch; save it in a checkpoint and pass it back
    to resume the same order.
    """

    def __init__(self, dataset: GPTDataset, batch_size: int, consumed_samples: int = 0) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.consumed_samples = consumed_samples

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        batch = get_batch(self.dataset, self.consumed_samples, self.batch_size)
        self.consumed_samples += self.batch_size
        return batch
