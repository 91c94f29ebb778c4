"""Interop with the `megatron-core` package (0.16.1): files trireme writes are read by its
IndexedDataset with identical tokens, and files its IndexedDatasetBuilder writes train in
trireme."""

import json
import warnings

import numpy as np
import pytest
import torch

from trireme.config import load_config
from trireme.data.indexed import IndexedDataset
from trireme.data.preprocess import PreprocessOptions, merge_datasets, preprocess
from trireme.training.build import build_trainer
from trireme.training.train import train

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # "Transformer Engine and Apex are not installed"
    megatron = pytest.importorskip(
        "megatron.core.datasets.indexed_dataset",
        reason="megatron-core is not installed (pip install --no-deps megatron-core==0.16.1)",
    )


def same_dataset(ours: IndexedDataset, theirs) -> None:
    assert len(theirs) == len(ours)
    np.testing.assert_array_equal(theirs.sequence_lengths, ours.sequence_lengths)
    np.testing.assert_array_equal(theirs.document_indices, ours.document_indices)
    assert theirs.index.dtype == ours.dtype
    for i in range(len(ours)):
        np.testing.assert_array_equal(theirs[i], ours[i])
        assert theirs[i].dtype == ours[i].dtype


@pytest.mark.parametrize("split", [False, True])
def test_megatron_reads_what_trireme_preprocesses(tmp_path, split):
    texts = ["First doc. Two sentences!", "", "ünïcödé ✓ third", "x" * 500, "Last one."]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess(PreprocessOptions([str(src)], str(tmp_path / "p"), "bytes", append_eod=True,
                                 split_sentences=split, progress=False))
    prefix = str(tmp_path / ("p_text_sentence" if split else "p_text_document"))
    ours = IndexedDataset(prefix)
    same_dataset(ours, megatron.IndexedDataset(prefix))
    merged = merge_datasets([prefix, prefix], str(tmp_path / "merged"))
    same_dataset(merged, megatron.IndexedDataset(str(tmp_path / "merged")))


def build_with_megatron(prefix, dtype=np.uint16):
    rng = np.random.default_rng(0)
    builder = megatron.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    documents = []
    for d in range(80):
        if d % 10 == 3:  # a document of several sequences
            parts = [rng.integers(0, 256, n) for n in (7, 0, 12)]
            builder.add_document(torch.from_numpy(np.concatenate(parts)), [len(p) for p in parts])
        else:  # a one-sequence document, the way add_item + end_document writes it
            parts = [np.append(rng.integers(0, 256, rng.integers(0, 60)), 256)]
            builder.add_item(torch.from_numpy(parts[0]))
            builder.end_document()
        documents.append(parts)
    builder.finalize(prefix + ".idx")
    return documents


def test_trireme_reads_and_trains_on_megatron_files(tmp_path):
    prefix = str(tmp_path / "meg")
    documents = build_with_megatron(prefix)
    ours = IndexedDataset(prefix)
    same_dataset(ours, megatron.IndexedDataset(prefix))
    di = ours.document_indices
    for d, parts in enumerate(documents):
        assert [ours[i].tolist() for i in range(di[d], di[d + 1])] == [p.tolist() for p in parts]
    cfg = load_config("tiny", [
        f"data.path={prefix}", "data.tokenizer=bytes", f"run.dir={tmp_path}/run",
        f"data.cache_dir={tmp_path}/cache", "model.num_layers=1", "model.hidden_size=32",
        "model.num_attention_heads=2", "model.ffn_hidden_size=64", "model.seq_length=16",
        "train.global_batch_size=4", "train.micro_batch_size=2", "train.steps=3",
        "train.log_interval=1", "train.eval_interval=0", "train.sample_tokens=0",
        "logging.progress=false", "logging.tensorboard=false",
    ])
    trainer = build_trainer(cfg)
    tokens = trainer.train_data.get_samples(np.arange(trainer.train_data.samples_per_epoch))
    assert set(np.unique(tokens)) <= set(np.unique(ours.tokens))
    train(cfg)
    records = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 3 and all(np.isfinite(json.loads(r)["loss"]) for r in records)
