import errno
import os
import struct

import numpy as np
import pytest

from trireme.data.indexed import IndexedDataset, IndexedDatasetWriter, best_dtype
from trireme.errors import DataError


def write(prefix, documents, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in documents:
            writer.add_document(doc)
    return str(prefix)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32, np.int64, np.float32])
def test_round_trip(tmp_path, dtype):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 200, size=n).astype(dtype) for n in (5, 0, 17, 1, 300)]
    ds = IndexedDataset(write(tmp_path / "d", docs, dtype))
    assert ds.dtype == np.dtype(dtype)
    assert len(ds) == 5 and ds.num_documents == 5
    assert ds.num_tokens == sum(map(len, docs))
    assert ds.sequence_lengths.tolist() == [5, 0, 17, 1, 300]
    itemsize = np.dtype(dtype).itemsize
    assert ds.sequence_pointers.tolist() == [p * itemsize for p in (0, 5, 5, 22, 23)]
    assert ds.document_indices.tolist() == [0, 1, 2, 3, 4, 5]
    for i, doc in enumerate(docs):
        np.testing.assert_array_equal(ds[i], doc)
    np.testing.assert_array_equal(ds.get(4, offset=10, length=7), docs[4][10:17])
    np.testing.assert_array_equal(ds.get(2, offset=3), docs[2][3:])
    np.testing.assert_array_equal(ds[-1], docs[-1])
    with pytest.raises(IndexError):
        ds[5]
    with pytest.raises(IndexError):
        ds.get(0, offset=3, length=3)


def test_lists_and_prefix_with_extension(tmp_path):
    prefix = write(tmp_path / "d", [[1, 2, 3], [65000]])
    for name in (prefix, prefix + ".bin", prefix + ".idx"):
        assert IndexedDataset(name)[1].tolist() == [65000]


def test_token_out_of_dtype_range(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    with pytest.raises(DataError, match="70000"):
        writer.add_document([1, 70000])
    writer.abort()
    assert os.listdir(tmp_path) == []


def test_token_ids_that_are_not_whole_numbers_are_refused(tmp_path):
    """Float ids were cast silently (1.5 written as 1); a negative id was told to use a wider
    dtype. Whole floats (np.concatenate with an empty list gives float64) are still taken."""
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    with pytest.raises(DataError, match="token id 1.5 is not a whole number"):
        writer.add_document([2.0, 1.5])
    with pytest.raises(DataError, match="token id nan is not a whole number"):
        writer.add_document(np.array([np.nan]))
    with pytest.raises(DataError, match="token ids must be integers, not <U1"):
        writer.add_document(["a"])
    with pytest.raises(DataError, match=r"token id -1 does not fit in uint16$"):
        writer.add_document([3, -1])
    writer.add_document(np.concatenate([[], [4, 5]]))
    writer.finalize()
    assert IndexedDataset(tmp_path / "d")[0].tolist() == [4, 5]


def test_best_dtype():
    assert best_dtype(50257) == np.uint16
    assert best_dtype(65499) == np.uint16
    assert best_dtype(65500) == np.int32
    assert best_dtype(128256) == np.int32


def test_idx_bytes_match_megatron_layout(tmp_path):
    """The Megatron compatibility check: the .idx is exactly the layout of REFERENCE.md §1."""
    docs = [[10, 11, 12], [13], [14, 15]]
    prefix = write(tmp_path / "d", docs, np.uint16)
    expected = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<Q", 1)  # version
        + struct.pack("<B", 8)  # dtype code: uint16
        + struct.pack("<Q", 3)  # N sequences
        + struct.pack("<Q", 4)  # D = documents + 1
        + struct.pack("<3i", 3, 1, 2)  # sequence_lengths
        + struct.pack("<3q", 0, 6, 8)  # sequence_pointers (bytes)
        + struct.pack("<4q", 0, 1, 2, 3)  # document_indices
    )
    assert open(prefix + ".idx", "rb").read() == expected
    assert open(prefix + ".bin", "rb").read() == struct.pack("<6H", 10, 11, 12, 13, 14, 15)


def test_reads_hand_built_multi_sequence_documents(tmp_path):
    # A sentence-split dataset as Megatron writes it: 2 documents of 2 and 1 sequences, int32.
    prefix = str(tmp_path / "m")
    idx = (
        b"MMIDIDX\x00\x00"
        + struct.pack("<QBQQ", 1, 4, 3, 3)
        + struct.pack("<3i", 2, 1, 3)
        + struct.pack("<3q", 0, 8, 12)
        + struct.pack("<3q", 0, 2, 3)
    )
    open(prefix + ".idx", "wb").write(idx)
    open(prefix + ".bin", "wb").write(struct.pack("<6i", 1, 2, 3, 4, 5, 6))
    ds = IndexedDataset(prefix)
    assert (len(ds), ds.num_documents, ds.dtype) == (3, 2, np.int32)
    assert ds[2].tolist() == [4, 5, 6]


@pytest.fixture
def dataset(tmp_path):
    return write(tmp_path / "d", [[1, 2, 3], [4, 5], [6]])


def corrupt_idx(prefix, offset, data):
    raw = bytearray(open(prefix + ".idx", "rb").read())
    raw[offset : offset + len(data)] = data
    open(prefix + ".idx", "wb").write(bytes(raw))


def expect_error(prefix, *words):
    with pytest.raises(DataError) as info:
        IndexedDataset(prefix)
    message = str(info.value)
    assert prefix in message and "\n" not in message
    for word in words:
        assert word in message, message


def test_bad_magic(dataset):
    corrupt_idx(dataset, 0, b"XXXX")
    expect_error(dataset, "d.idx", "magic")


def test_bad_version(dataset):
    corrupt_idx(dataset, 9, struct.pack("<Q", 2))
    expect_error(dataset, "d.idx", "version 2")


def test_unknown_dtype_code(dataset):
    corrupt_idx(dataset, 17, b"\x09")
    expect_error(dataset, "d.idx", "dtype code 9")


@pytest.mark.parametrize("keep", [10, 40, 80])
def test_truncated_idx(dataset, keep):
    raw = open(dataset + ".idx", "rb").read()
    open(dataset + ".idx", "wb").write(raw[:keep])
    expect_error(dataset, "d.idx", "truncated")


def test_document_indices_disagree(dataset):
    corrupt_idx(dataset, 34 + 12 * 3 + 8 * 3, struct.pack("<q", 2))  # last document index
    expect_error(dataset, "d.idx", "document indices")


@pytest.mark.parametrize("size", [0, 10, 14])
def test_bin_of_wrong_size(dataset, size):
    raw = open(dataset + ".bin", "rb").read()
    open(dataset + ".bin", "wb").write((raw + b"\0" * 8)[:size])
    expect_error(dataset, "d.bin", f"{size} bytes")


@pytest.mark.parametrize("suffix", [".bin", ".idx"])
def test_missing_file(dataset, suffix):
    os.remove(dataset + suffix)
    expect_error(dataset, f"d{suffix} not found")


def test_missing_both(tmp_path):
    expect_error(str(tmp_path / "nothing"), "nothing.bin and nothing.idx not found")


def test_interrupted_writer_leaves_no_idx(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with IndexedDatasetWriter(tmp_path / "d", np.uint16) as writer:
            writer.add_document([1, 2, 3])
            raise KeyboardInterrupt
    assert os.listdir(tmp_path) == []


def test_unfinished_writer_leaves_no_idx(tmp_path):
    writer = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    writer.add_document([1, 2, 3])  # process dies here: only a hidden temporary exists
    assert not any(name.endswith((".idx", ".bin")) for name in os.listdir(tmp_path))
    with pytest.raises(DataError, match="not found"):
        IndexedDataset(tmp_path / "d")
    writer.abort()


def test_rewrite_replaces_old_dataset(tmp_path):
    write(tmp_path / "d", [[1, 2, 3]])
    write(tmp_path / "d", [[7], [8, 9]])
    ds = IndexedDataset(tmp_path / "d")
    assert [ds[i].tolist() for i in range(len(ds))] == [[7], [8, 9]]
    assert sorted(os.listdir(tmp_path)) == ["d.bin", "d.idx"]


def test_pickle_reopens(dataset):
    import pickle

    ds = pickle.loads(pickle.dumps(IndexedDataset(dataset)))
    assert ds[0].tolist() == [1, 2, 3]


class _FullDisk:
    """A spool file whose flush fails as on a full disk (after really closing it)."""

    def __init__(self, real) -> None:
        self.real, self.closed = real, False

    def write(self, data: bytes) -> int:
        return self.real.write(data)

    def close(self) -> None:
        self.real.close()
        self.closed = True
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_disk_is_one_line_and_leaves_no_temporaries(tmp_path):
    writer = IndexedDatasetWriter(str(tmp_path / "d"), np.uint16)
    writer.add_document([1, 2, 3])
    writer._lengths_file = _FullDisk(writer._lengths_file)
    with pytest.raises(DataError, match="No space left on device"):
        writer.finalize()
    assert os.listdir(tmp_path) == []  # the .bin, the spools and the .idx temporaries are gone
    with pytest.raises(DataError, match="writing .*failed.*No space left"):
        with IndexedDatasetWriter(str(tmp_path / "e"), np.uint16) as w:
            w.add_document([4, 5])
            w._bin_file = _FullDisk(w._bin_file)
            w._bin_file.write = _full  # the next document's tokens do not fit on the disk
            w.add_document([6, 7])
    assert os.listdir(tmp_path) == []
    with pytest.raises(PermissionError):  # anything else in the block stays what it is
        with IndexedDatasetWriter(str(tmp_path / "f"), np.uint16) as w:
            raise PermissionError(errno.EACCES, "an input that cannot be read")
    assert os.listdir(tmp_path) == []


def _full(data: bytes) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")
