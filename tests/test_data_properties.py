"""Property tests (hypothesis): random documents round-trip through .bin/.idx, and a blend keeps
every dataset's share within one sample of its weight at every prefix of the stream."""

import numpy as np
import pytest

pytest.importorskip("hypothesis", reason="property tests need hypothesis (the test extra)")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from trireme.data.blend import blend_period, exact_weights  # noqa: E402
from trireme.data.indexed import IndexedDataset, IndexedDatasetWriter  # noqa: E402


def max_error(shares, period, seed=0, repeats=3):
    """The largest |count_d(n) - w_d * n| over the first `repeats` periods of the blend."""
    choice = np.tile(blend_period(shares, period, seed), repeats)
    onehot = np.zeros((choice.size, len(shares)))
    onehot[np.arange(choice.size), choice] = 1
    counts = np.cumsum(onehot, axis=0)
    n = np.arange(1, choice.size + 1)[:, None]
    return np.abs(counts - n * np.asarray(shares) / period).max()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=6), st.integers(0, 2**32))
def test_share_error_below_one_sample_at_every_prefix(weights, seed):
    shares, period = exact_weights(weights)
    assert max_error(shares, period, seed) < 1


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.lists(st.integers(0, 65535), max_size=20), max_size=4), max_size=12),
    st.sampled_from([np.uint16, np.int32, np.int64]),
)
def test_random_documents_round_trip(tmp_path_factory, documents, dtype):
    """Property: any documents (of any number of sequences, empty ones too) read back as written."""
    prefix = tmp_path_factory.mktemp("prop") / "d"
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for i, doc in enumerate(documents):
            if i % 2:
                writer.add_document(np.concatenate([np.asarray(s, dtype=np.int64) for s in doc])
                                    if doc else np.zeros(0, np.int64), [len(s) for s in doc])
            else:  # the batched path
                flat = [t for s in doc for t in s]
                writer.add_documents(np.asarray(flat, dtype=np.int64), [len(s) for s in doc],
                                     [len(doc)])
    ds = IndexedDataset(prefix)
    assert ds.num_documents == len(documents) and ds.dtype == np.dtype(dtype)
    di = ds.document_indices
    for d, doc in enumerate(documents):
        assert [ds[i].tolist() for i in range(di[d], di[d + 1])] == doc
