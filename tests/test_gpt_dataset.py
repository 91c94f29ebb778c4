import numpy as np
import pytest
import torch

from trireme.data.gpt_dataset import BatchIterator, GPTDataset, get_batch, split_documents
from trireme.data.indexed import IndexedDataset, IndexedDatasetWriter
from trireme.errors import ConfigError, DataError

SEQ = 8


@pytest.fixture(scope="module")
def indexed(tmp_path_factory):
    """40 documents of 0-30 tokens; document d holds d*1000, d*1000+1, ... so every token is unique
    and tells which document and position it came from."""
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("data") / "d"
    with IndexedDatasetWriter(prefix, np.int32) as writer:
        for d in range(40):
            writer.add_document(d * 1000 + np.arange(rng.integers(0, 31)))
    return IndexedDataset(prefix)


def test_samples_are_contiguous_slices_of_the_stream(indexed):
    ds = GPTDataset(indexed, SEQ, seed=1)
    samples = ds.get_samples(np.arange(ds.samples_per_epoch))  # [n, SEQ + 1]
    assert samples.shape == (ds.samples_per_epoch, SEQ + 1) and samples.dtype == np.int64
    # Put the samples back in stream order: one of them starts the stream (no other sample ends
    # with its first token), and each next one starts with the last token of the one before.
    by_first = {int(s[0]): s for s in samples}
    last_tokens = {int(s[-1]) for s in samples}
    (start,) = [s for s in samples if int(s[0]) not in last_tokens]
    stream = [start]
    while int(stream[-1][-1]) in by_first:
        stream.append(by_first[int(stream[-1][-1])])
    assert len(stream) == ds.samples_per_epoch  # a single chain covers every sample
    tokens = np.concatenate([stream[0]] + [s[1:] for s in stream[1:]])
    # The stream is whole documents back to back, the last one cut where the epoch ends.
    doc = tokens // 1000
    runs = np.split(tokens, np.nonzero(np.diff(doc))[0] + 1)
    for run in runs[:-1]:
        np.testing.assert_array_equal(run, indexed[int(run[0]) // 1000])
    np.testing.assert_array_equal(runs[-1], indexed[int(runs[-1][0]) // 1000][: len(runs[-1])])
    assert len(set(doc.tolist())) == len(runs)  # no document appears twice in an epoch


def test_epoch_covers_every_token(indexed):
    ds = GPTDataset(indexed, SEQ, seed=3)
    assert ds.tokens_per_epoch == indexed.num_tokens
    assert ds.samples_per_epoch == (indexed.num_tokens - 1) // SEQ
    samples = ds.get_samples(np.arange(ds.samples_per_epoch))
    seen = np.unique(samples)
    # at most the SEQ - 1 leftover tokens at the end of the epoch's stream are not covered
    assert indexed.num_tokens - len(seen) <= SEQ - 1
    assert np.isin(seen, indexed.tokens).all()


def test_getitem_matches_get_samples(indexed):
    ds = GPTDataset(indexed, SEQ, seed=3)
    for i in (0, 5, ds.samples_per_epoch - 1, ds.samples_per_epoch, 3 * ds.samples_per_epoch + 2):
        np.testing.assert_array_equal(ds[i], ds.get_samples([i])[0])


def test_deterministic_by_seed(indexed):
    n = 3 * GPTDataset(indexed, SEQ, seed=0).samples_per_epoch
    a = GPTDataset(indexed, SEQ, seed=7).get_samples(np.arange(n))
    b = GPTDataset(indexed, SEQ, seed=7).get_samples(np.arange(n)[::-1])[::-1]
    c = GPTDataset(indexed, SEQ, seed=8).get_samples(np.arange(n))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_epoch_wrap_reshuffles(indexed):
    ds = GPTDataset(indexed, SEQ, seed=5)
    n = ds.samples_per_epoch
    first, second = ds.get_samples(np.arange(n)), ds.get_samples(np.arange(n, 2 * n))
    assert not np.array_equal(first, second)
    # a new document order too, not only a new sample order
    assert {tuple(s) for s in first.tolist()} != {tuple(s) for s in second.tolist()}


def test_document_subset(indexed):
    ids = np.arange(10, 20)
    ds = GPTDataset(indexed, SEQ, seed=0, document_ids=ids)
    assert ds.tokens_per_epoch == int(indexed.sequence_lengths[10:20].sum())
    samples = ds.get_samples(np.arange(2 * ds.samples_per_epoch))
    assert set((samples // 1000).ravel().tolist()) <= set(ids.tolist())


def test_too_little_data(indexed):
    with pytest.raises(DataError, match="seq_length"):
        GPTDataset(indexed, 4096, seed=0)
    with pytest.raises(DataError, match="0 documents"):
        GPTDataset(indexed, SEQ, seed=0, document_ids=np.arange(0))


def test_get_batch_resume_continuity(indexed):
    ds = GPTDataset(indexed, SEQ, seed=2)
    k, b = ds.samples_per_epoch - 2, 4  # a batch that crosses into the next epoch
    tokens, labels = get_batch(ds, k, b)
    assert tokens.shape == labels.shape == (b, SEQ) and tokens.dtype == torch.int64
    expected = torch.from_numpy(np.stack([ds[k + j] for j in range(b)]))
    assert torch.equal(tokens, expected[:, :-1]) and torch.equal(labels, expected[:, 1:])
    # resuming from a checkpoint (a fresh dataset, consumed_samples saved) continues the order
    straight = BatchIterator(ds, batch_size=3)
    run = [next(straight) for _ in range(5)]
    resumed = BatchIterator(GPTDataset(indexed, SEQ, seed=2), batch_size=3, consumed_samples=6)
    for expected_tokens, _ in run[2:]:
        assert torch.equal(next(resumed)[0], expected_tokens)
    assert resumed.consumed_samples == 15


def test_split_documents_ratios():
    train, valid, test = split_documents(1000, "969,30,1")
    assert (len(train), len(valid), len(test)) == (969, 30, 1)
    assert np.array_equal(np.concatenate([train, valid, test]), np.arange(1000))
    train, valid, test = split_documents(100)
    assert (len(train), len(valid), len(test)) == (96, 3, 1)  # each non-empty share >= 1
    train, valid, test = split_documents(10, "8,2,0")
    assert (len(train), len(valid), len(test)) == (8, 2, 0)
    train, valid, test = split_documents(3, "98,1,1")
    assert (len(train), len(valid), len(test)) == (1, 1, 1)
    train, valid, test = split_documents(7, "1")
    assert (len(train), len(valid), len(test)) == (7, 0, 0)
    for n in range(0, 60):
        parts = split_documents(n, "7,2,1")
        assert sum(map(len, parts)) == n
        assert np.array_equal(np.concatenate(parts), np.arange(n))
    with pytest.raises(ConfigError, match="data.split"):
        split_documents(10, "a,b")
    with pytest.raises(ConfigError, match="data.split"):
        split_documents(10, "0,0,0")
