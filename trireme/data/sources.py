"""From `data.*` config to training datasets: one prefix, a weighted blend, or mock data.

`open_sources(path)` opens every dataset of `data.path` (checking the files first);
`build_split_datasets(...)` cuts each into train / valid / test by `data.split`, wraps each split in
a cached GPTDataset, and blends them by weight when there are several.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trireme.data.batch import BatchOptions
from trireme.data.blend import BlendedDataset, parse_blend
from trireme.data.gpt_dataset import GPTDataset, split_documents
from trireme.data.indexed import IndexedDataset
from trireme.data.mock import MockGPTDataset
from trireme.errors import ConfigError


@dataclass
class DataSources:
    """The opened datasets of `data.path`, with their weights as written (empty for mock)."""

    datasets: list[IndexedDataset] = field(default_factory=list)
    weights: list[str] = field(default_factory=list)
    eod: int = -1  # the tokenizer's end-of-document id, when known

    @property
    def num_tokens(self) -> int:
        return sum(d.num_tokens for d in self.datasets)


def open_sources(path: str) -> DataSources:
    pairs = parse_blend(path)
    return DataSources([IndexedDataset(prefix) for _, prefix in pairs], [w for w, _ in pairs])


def unique_names(datasets: list[IndexedDataset]) -> list[str]:
    names = [Path(d.prefix).name for d in datasets]
    return [n if names.count(n) == 1 else f"{n}.{i}" for i, n in enumerate(names)]


def build_split_datasets(
    sources: DataSources | None,
    *,
    seq_length: int,
    seed: int,
    split: str,
    options: BatchOptions,
    cache_dir: str | Path | None,
    mock_vocab_size: int = 0,
    want_valid: bool = True,
    log_samples: int = 0,
):
    """(train, valid or None) datasets. With no sources, mock data of `mock_vocab_size` ids.

    `log_samples` > 0 prints, for a blend, each dataset's share of that many training samples.
    """
    if options.eod < 0 and (options.eod_mask_loss or options.reset_position_ids
                            or options.reset_attention_mask):
        raise ConfigError(
            "data.eod_mask_loss / reset_position_ids / reset_attention_mask need the "
            "end-of-document id: set data.tokenizer"
        )
    if sources is None or not sources.datasets:
        train = MockGPTDataset(mock_vocab_size, seq_length, seed, options=options)
        valid = MockGPTDataset(mock_vocab_size, seq_length, seed + 1, options=options,
                               name="mock-valid")
        return train, (valid if want_valid else None)
    names = unique_names(sources.datasets)
    per_split: list[list[GPTDataset | None]] = [[], []]
    for dataset, name in zip(sources.datasets, names):
        train_ids, valid_ids, _ = split_documents(dataset.num_documents, split)
        for k, (ids, suffix) in enumerate(((train_ids, "train"), (valid_ids, "valid"))):
            ds = None
            if len(ids) and (k == 0 or want_valid):
                ds = GPTDataset(dataset, seq_length, seed, ids, cache_dir=cache_dir,
                                options=options, name=f"{name}-{suffix}")
            per_split[k].append(ds)
    train_parts, valid_parts = per_split
    if any(d is None for d in train_parts):
        raise ConfigError(f"data.split = {split!r} leaves a dataset without training documents")
    if len(train_parts) == 1:
        return train_parts[0], valid_parts[0]
    train = BlendedDataset(train_parts, sources.weights, seed, names)
    if log_samples:
        train.log(log_samples)
    valid = None
    kept = [(d, w, n) for d, w, n in zip(valid_parts, sources.weights, names) if d is not None]
    if kept:
        valid = BlendedDataset([d for d, _, _ in kept], [w for _, w, _ in kept], seed,
                               [n for _, _, n in kept])
    return train, valid
