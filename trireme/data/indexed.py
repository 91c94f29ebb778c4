"""Megatron's indexed dataset: token ids in `P.bin`, an index in `P.idx`, byte for byte.

A dataset is a path prefix `P`. `P.bin` is every sequence's token ids back to back, no header.
`P.idx` is little-endian, fields back to back (see docs / REFERENCE.md §1):

    magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | N u64 | D u64
    sequence_lengths   int32[N]   tokens in each sequence
    sequence_pointers  int64[N]   byte offset of each sequence in P.bin
    document_indices   int64[D]   0, then the number of sequences after each document (last = N)
    sequence_modes     int8[N]    only in multimodal datasets (read past, never written)

Without sentence splitting, one document is one sequence, so D = N + 1 (an empty document has
zero sequences, as Megatron's preprocessing writes it). Files written here are readable by
Megatron-LM and the other way round.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import struct
import uuid
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import numpy as np

from trireme.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, N, D: 34 bytes

DTYPE_CODES: dict[int, type[np.generic]] = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
CODE_OF_DTYPE: dict[np.dtype, int] = {np.dtype(t): c for c, t in DTYPE_CODES.items()}


def best_dtype(vocab_size: int) -> np.dtype:
    """The token dtype Megatron's preprocessing picks: uint16 below 65,500 ids, else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def _strip_extension(prefix: str | os.PathLike[str]) -> str:
    """`P`, `P.bin` and `P.idx` all name the dataset `P`."""
    s = os.fspath(prefix)
    return s[:-4] if s.endswith((".bin", ".idx")) else s


def temporary_path(path: str | os.PathLike[str]) -> str:
    """A unique hidden name beside `path` (same filesystem, so a rename into place is atomic)."""
    directory, name = os.path.split(os.path.abspath(path))
    return os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def read_sidecar(path: str, what: str, hint: str = "") -> dict | None:
    """A dataset's JSON sidecar (write_sidecar), None where there is none; one that cannot be
    read, or is not a JSON object, is a one-line DataError naming it as `what` (+ `hint`)."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read ({e}){hint}") from None
    if not isinstance(record, dict):
        raise DataError(f"{path} is not {what}{hint}")
    return record


def write_sidecar(path: str, record: dict | None) -> None:
    """A dataset's JSON sidecar (P.chat.json, P.tokenizer.json), written whole or not at all;
    None removes one an earlier dataset of that name left."""
    if record is None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    temp = temporary_path(path)
    with open(temp, "w", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    os.replace(temp, path)


def check_writable(path: str, flag: str) -> list[str]:
    """DataError (one line, naming `path`) unless files can be created at `path`; call before any
    work. Returns the directories that do not exist yet (deepest last), which the writer will
    create, so that a failed run can remove them again."""
    if path.endswith(os.sep) or os.path.isdir(path):
        raise DataError(f"{flag} {path!r} is a directory; give a path prefix inside it, e.g. "
                        f"{os.path.join(path, 'name')!r}")
    existing, missing = os.path.dirname(os.path.abspath(path)), []
    while not os.path.exists(existing):
        existing, missing = os.path.dirname(existing), [existing, *missing]
    if not os.path.isdir(existing):
        raise DataError(f"{flag} {path!r}: {existing!r} is a file, not a directory")
    probe = temporary_path(os.path.join(existing, "probe"))
    try:
        open(probe, "xb").close()
        os.remove(probe)
    except OSError as e:
        raise DataError(f"{flag} {path!r}: cannot write in {existing!r} ({e.strerror or e}); "
                        "give a writable location") from None
    return missing


class IndexedDatasetWriter:
    """Write a `.bin/.idx` pair, one document at a time or many at once, in constant memory.

    A document is one sequence (the default) or several (`sequence_lengths`, from sentence
    splitting); a document of zero sequences is allowed and is what Megatron's preprocessing
    writes for an empty text. Tokens and the per-sequence lengths stream to hidden temporary files
    next to the target, so memory does not grow with the data; `finalize()` writes the index and
    renames both into place (the `.idx` last), so an interrupted run never leaves a valid-looking
    `P.idx`. As a context manager it finalizes on a clean exit and removes its temporaries on an
    exception.
    """

    def __init__(self, prefix: str | os.PathLike[str], dtype: np.dtype | type | str) -> None:
        self.prefix = _strip_extension(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in CODE_OF_DTYPE:
            raise ValueError(f"dtype {self.dtype} has no Megatron dtype code")
        self._bin_tmp = temporary_path(self.prefix + ".bin")
        self._lengths_tmp = temporary_path(self.prefix + ".lengths")
        self._ends_tmp = temporary_path(self.prefix + ".documents")
        self._idx_tmp: str | None = None
        try:
            os.makedirs(os.path.dirname(os.path.abspath(self.prefix)), exist_ok=True)
            self._bin_file = open(self._bin_tmp, "xb", buffering=1 << 22)
            self._lengths_file = open(self._lengths_tmp, "xb", buffering=1 << 20)  # int32 each
            self._ends_file = open(self._ends_tmp, "xb", buffering=1 << 20)  # int64 per document
        except OSError as e:
            for f in ("_bin_file", "_lengths_file"):
                if hasattr(self, f):
                    getattr(self, f).close()
            self._remove_spools()
            for path in (self._bin_tmp,):
                if os.path.exists(path):
                    os.remove(path)
            raise DataError(f"cannot write {self.prefix}.bin / .idx ({e.strerror or e})") from None
        self.num_sequences = 0
        self.num_documents = 0
        self.num_tokens = 0
        self._done = False
        if np.issubdtype(self.dtype, np.integer):
            info = np.iinfo(self.dtype)
            self._bounds: tuple[int, int] | None = (int(info.min), int(info.max))
        else:
            self._bounds = None

    def _tokens_array(self, tokens: Sequence[int] | np.ndarray) -> np.ndarray:
        array = np.asarray(tokens)
        if array.ndim != 1:
            raise ValueError(f"a document must be a 1-d sequence of token ids, not {array.shape}")
        if array.dtype != self.dtype:
            if self._bounds is not None and array.size:
                self._check_ids(array)
            array = array.astype(self.dtype)
        return array

    def _check_ids(self, array: np.ndarray) -> None:
        """Token ids an integer dtype holds as they are: whole numbers in its range (a cast
        would truncate 1.5 to 1, or wrap 70000 around, silently)."""
        if array.dtype.kind == "f":  # e.g. np.concatenate with an empty (float) array
            whole = np.isfinite(array) & (array == np.floor(array))
            if not whole.all():
                raise DataError(f"{self.prefix}.bin: token id {float(array[~whole][0])} is not "
                                "a whole number")
        elif array.dtype.kind not in "iub":
            raise DataError(f"{self.prefix}.bin: token ids must be integers, not {array.dtype}")
        lo, hi = int(array.min()), int(array.max())
        if lo < self._bounds[0]:  # a wider dtype would not help a negative id
            raise DataError(f"{self.prefix}.bin: token id {lo} does not fit in {self.dtype}")
        if hi > self._bounds[1]:
            raise DataError(f"{self.prefix}.bin: token id {hi} does not fit in {self.dtype}; "
                            "write with a wider dtype (best_dtype(vocab_size))")

    def add_document(
        self,
        tokens: Sequence[int] | np.ndarray,
        sequence_lengths: Sequence[int] | np.ndarray | None = None,
    ) -> None:
        """Append one document: its tokens, as one sequence or split by `sequence_lengths`."""
        array = self._tokens_array(tokens)
        lengths = [array.size] if sequence_lengths is None else sequence_lengths
        self.add_documents(array, np.asarray(lengths, dtype=np.int64), [len(lengths)])

    def add_documents(
        self,
        tokens: np.ndarray,
        sequence_lengths: np.ndarray | Sequence[int],
        sequences_per_document: np.ndarray | Sequence[int],
    ) -> None:
        """Append many documents at once: all their tokens back to back, the length of every
        sequence, and how many sequences each document has (0 for an empty document)."""
        if self._done:
            raise RuntimeError(f"{self.prefix}: add_documents after finalize")
        array = self._tokens_array(tokens)
        lengths = np.asarray(sequence_lengths, dtype=np.int64)
        counts = np.asarray(sequences_per_document, dtype=np.int64)
        if int(lengths.sum()) != array.size or int(counts.sum()) != lengths.size:
            raise ValueError(
                f"{array.size} tokens, {lengths.size} sequence lengths summing to "
                f"{int(lengths.sum())} and {int(counts.sum())} sequences per document disagree"
            )
        if lengths.size and (lengths.min() < 0 or lengths.max() > np.iinfo(np.int32).max):
            raise DataError(f"{self.prefix}.idx: a sequence length is negative or above 2^31-1")
        if counts.size and counts.min() < 0:
            raise ValueError("a document cannot have a negative number of sequences")
        ends = self.num_sequences + np.cumsum(counts)
        self._write((self._bin_file, array), (self._lengths_file, lengths.astype("<i4")),
                    (self._ends_file, ends.astype("<i8")))
        self.num_sequences += lengths.size
        self.num_documents += counts.size
        self.num_tokens += array.size

    def append(self, other: IndexedDataset, chunk_tokens: int = 1 << 24) -> None:
        """Append every document of an opened dataset (its tokens converted to this dtype)."""
        if self._done:
            raise RuntimeError(f"{self.prefix}: append after finalize")
        tokens = other.tokens
        for start in range(0, tokens.size, chunk_tokens):
            self._write((self._bin_file,
                         self._tokens_array(tokens[start : start + chunk_tokens])))
        ends = other.document_indices[1:].astype(np.int64) + self.num_sequences
        self._write((self._lengths_file, np.asarray(other.sequence_lengths, dtype="<i4")),
                    (self._ends_file, ends.astype("<i8")))
        self.num_sequences += len(other)
        self.num_documents += other.num_documents
        self.num_tokens += other.num_tokens

    def finalize(self) -> None:
        """Write the index and move `P.bin` then `P.idx` into place."""
        if self._done:
            return
        try:
            self._write_index()
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError):
                raise self.write_error(e) from None
            raise
        self._remove_spools()
        self._done = True

    def _write(self, *pieces: tuple[Any, np.ndarray]) -> None:
        """Each array's bytes to its file; a failed write (a full disk) is one DataError (the
        `with` block or finalize then removes the temporaries)."""
        try:
            for file, array in pieces:
                file.write(array.tobytes())
        except OSError as e:
            raise self.write_error(e) from None

    def write_error(self, error: OSError) -> DataError:
        """The one-line error of a failed write (a full disk), after `abort`."""
        return DataError(f"writing {self.prefix}.bin / .idx failed ({error.strerror or error}); "
                         "nothing was left under those names")

    def _write_index(self, chunk: int = 1 << 22) -> None:
        failed = None
        for f in (self._bin_file, self._lengths_file, self._ends_file):
            try:  # close all three, even if a flush fails (a full disk)
                f.close()
            except OSError as e:
                failed = failed or e
        if failed is not None:
            raise failed
        n, d = self.num_sequences, self.num_documents + 1
        self._idx_tmp = temporary_path(self.prefix + ".idx")
        with open(self._idx_tmp, "xb") as f:
            f.write(HEADER.pack(MAGIC, VERSION, CODE_OF_DTYPE[self.dtype], n, d))
            lengths = np.fromfile(self._lengths_tmp, dtype="<i4") if n else np.zeros(0, "<i4")
            f.write(lengths.tobytes())
            # byte offsets: 0, then the running sum of length x itemsize, a chunk at a time
            offset = 0
            for start in range(0, n, chunk):
                part = lengths[start : start + chunk].astype(np.int64) * self.dtype.itemsize
                pointers = np.cumsum(part) - part + offset
                offset = int(pointers[-1] + part[-1])
                f.write(pointers.astype("<i8").tobytes())
            del lengths
            f.write(np.zeros(1, dtype="<i8").tobytes())
            with open(self._ends_tmp, "rb") as ends:
                shutil.copyfileobj(ends, f, 1 << 22)
        # An old index must not describe the new .bin, even for a moment.
        if os.path.exists(self.prefix + ".idx"):
            os.remove(self.prefix + ".idx")
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(self._idx_tmp, self.prefix + ".idx")

    def _remove_spools(self) -> None:
        for path in (self._lengths_tmp, self._ends_tmp):
            if os.path.exists(path):
                os.remove(path)

    def abort(self) -> None:
        """Remove the temporaries; nothing is written under the final names."""
        for f in (self._bin_file, self._lengths_file, self._ends_file):
            if not f.closed:
                with contextlib.suppress(OSError):  # its flush may fail again: still removed
                    f.close()
        for path in (self._bin_tmp, self._idx_tmp):
            if path and os.path.exists(path):
                os.remove(path)
        self._remove_spools()
        self._done = True

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.finalize()
            return
        if not self._done:
            self.abort()


def _map(path: str) -> np.ndarray:
    """Memory-map a whole file read-only as bytes (an empty file gives an empty array)."""
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return np.zeros(0, dtype=np.uint8)
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(buffer, dtype=np.uint8)


class IndexedDataset:
    """A read-only, memory-mapped `.bin/.idx` dataset, validated when opened.

    `dataset[i]` is sequence i as a read-only numpy view of `P.bin` (copy it to modify it).
    `name` is what the user gave the prefix as (a config key, a flag), for the errors.
    """

    def __init__(self, prefix: str | os.PathLike[str], name: str = "data.path") -> None:
        self.prefix = _strip_extension(prefix)
        self.name = name
        self._open()

    def _error(self, message: str) -> DataError:
        return DataError(f"{self.name} {self.prefix!r}: {message}")

    def _open(self) -> None:
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        missing = [os.path.basename(p) for p in (bin_path, idx_path) if not os.path.isfile(p)]
        if missing:
            raise self._error(f"{' and '.join(missing)} not found")
        idx = _map(idx_path)
        name = os.path.basename(idx_path)
        if idx.size < HEADER.size:
            raise self._error(
                f"{name} is {idx.size} bytes, too short for an index header; truncated?"
            )
        magic, version, code, n, d = HEADER.unpack(idx[: HEADER.size].tobytes())
        if magic != MAGIC:
            raise self._error(f"{name} is not a Megatron indexed-dataset index (magic {magic!r})")
        if version != VERSION:
            raise self._error(f"{name} has index version {version}; only version 1 is supported")
        if code not in DTYPE_CODES:
            raise self._error(f"{name} has unknown token dtype code {code}")
        self._dtype = np.dtype(DTYPE_CODES[code])
        expected = HEADER.size + 12 * n + 8 * d
        if idx.size not in (expected, expected + n):  # + n: multimodal sequence_modes
            raise self._error(
                f"{name} is {idx.size} bytes but its header ({n} sequences, {d} document "
                f"indices) needs {expected}; truncated or corrupted"
            )
        offset = HEADER.size
        self._lengths = idx[offset : offset + 4 * n].view("<i4")
        offset += 4 * n
        self._pointers = idx[offset : offset + 8 * n].view("<i8")
        offset += 8 * n
        self._document_indices = idx[offset : offset + 8 * d].view("<i8")
        if d == 0 or self._document_indices[-1] != n or self._document_indices[0] != 0:
            last = int(self._document_indices[-1]) if d else "nothing"
            raise self._error(
                f"{name} lists {n} sequences but its document indices end at {last}; corrupted"
            )
        if np.any(np.diff(self._document_indices) < 0) or (n and self._lengths.min() < 0):
            raise self._error(f"{name} has decreasing document indices or negative lengths")
        self._num_tokens = int(self._lengths.sum(dtype=np.int64))

        data = _map(bin_path)
        need = self._num_tokens * self._dtype.itemsize
        if data.size != need:
            raise self._error(
                f"{os.path.basename(bin_path)} is {data.size} bytes but {name} describes "
                f"{self._num_tokens} {self._dtype} tokens ({need} bytes); truncated, or the two "
                f"files are from different datasets"
            )
        self._check_pointers(name)
        self._tokens = data.view(self._dtype)

    def _check_pointers(self, name: str, chunk: int = 1 << 22) -> None:
        """Sequence i must start where sequence i-1 ends: pointers are the running sum of the
        lengths times the token size (as Megatron writes them); anything else would read tokens
        shifted or from another sequence, silently."""
        offset, itemsize = 0, self._dtype.itemsize
        for start in range(0, len(self._lengths), chunk):
            sizes = self._lengths[start : start + chunk].astype(np.int64) * itemsize
            expected = np.cumsum(sizes) - sizes + offset
            wrong = np.flatnonzero(self._pointers[start : start + chunk] != expected)
            if wrong.size:
                i = int(wrong[0])
                raise self._error(
                    f"{name}: sequence {start + i} starts at byte "
                    f"{int(self._pointers[start + i])} of the .bin, but the lengths before it "
                    f"put it at {int(expected[i])}; corrupted index"
                )
            offset = int(expected[-1] + sizes[-1])

    # Memory maps do not pickle; a DataLoader worker reopens the files instead.
    def __getstate__(self) -> dict[str, str]:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.prefix = state["prefix"]
        self._open()

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def sequence_lengths(self) -> np.ndarray:
        """int32[N]: tokens in each sequence."""
        return self._lengths

    @property
    def sequence_pointers(self) -> np.ndarray:
        """int64[N]: byte offset of each sequence in the .bin file."""
        return self._pointers

    @property
    def document_indices(self) -> np.ndarray:
        """int64[D]: 0, then the number of sequences after each document."""
        return self._document_indices

    @property
    def num_documents(self) -> int:
        return len(self._document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    @property
    def tokens(self) -> np.ndarray:
        """All of the .bin file as one flat read-only array of tokens."""
        return self._tokens

    def __len__(self) -> int:
        return len(self._lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens `offset : offset + length` of sequence `i` (to its end when length is None)."""
        n = len(self._lengths)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {n} sequences in {self.prefix}")
        i = int(i) % n
        size = int(self._lengths[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(
                f"tokens [{offset}, {offset + length}) out of range for sequence {i} of {size}"
            )
        start = int(self._pointers[i]) // self._dtype.itemsize + offset
        return self._tokens[start : start + length]

    def __repr__(self) -> str:
        return (
            f"IndexedDataset({self.prefix!r}, sequences={len(self)}, "
            f"documents={self.num_documents}, tokens={self.num_tokens}, dtype={self.dtype})"
        )
