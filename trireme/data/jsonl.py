"""Reading JSONL input for preprocessing: plain, .gz or .zst, in blocks of whole lines.

The reader never holds more than one block (about a megabyte) of a file; each block carries the
number of its first line so that an error can name the file and line. `parse_lines` turns a block
into the texts of the chosen JSON keys, and names what is wrong with a bad line.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import BinaryIO

from trireme.errors import DataError

# Reasons a line is skipped with --skip-bad-lines (the keys of the counts printed at the end).
MALFORMED = "malformed JSON"
NOT_OBJECT = "not a JSON object"
MISSING_KEY = "missing key"
NOT_STRING = "non-string value"
BAD_UTF8 = "invalid UTF-8"
TOO_LONG = "document too long"
TABLE_SUFFIXES = (".parquet", ".pq", ".arrow")  # read by trireme.data.tables, not as lines
ZSTD_INPUT_BYTES = 1 << 16  # compressed bytes fed to the decompressor at a time


@dataclass(frozen=True)
class Piece:
    """Part of an input file: bytes [start, end) of a plain file (end None: to the end), or a
    whole compressed file. A line belongs to the piece where it starts."""

    path: str
    start: int = 0
    end: int | None = None


@dataclass
class Block:
    path: str
    first_line: int  # 1-based number of the block's first line in its file
    data: bytes  # whole lines, each ending in a newline (the last one may not)
    disk_bytes: int  # bytes of the file on disk this block accounts for (for progress)

    def where(self) -> str:
        return f"{self.path} (lines from {self.first_line})"

    @property
    def input_bytes(self) -> int:
        return len(self.data)


def is_compressed(path: str) -> bool:
    return path.endswith((".gz", ".zst", ".zstd"))


class _Source:
    """An input file opened for reading uncompressed bytes; `disk_position()` is where the
    reader is in the file on disk (compressed bytes for .gz / .zst)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.raw = open(path, "rb")
        self.stream: BinaryIO
        self.errors: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error)
        if path.endswith(".gz"):
            self.stream = gzip.GzipFile(fileobj=self.raw)
        elif path.endswith((".zst", ".zstd")):
            try:
                import zstandard
            except ImportError:
                self.raw.close()
                raise DataError(
                    f"{path}: reading .zst needs the 'zstandard' package: pip install zstandard"
                ) from None
            self.stream = _ZstdFrames(self.raw, zstandard.ZstdDecompressor())
            self.errors += (zstandard.ZstdError,)
        else:
            self.stream = self.raw

    def read(self, size: int) -> bytes:
        """Up to `size` uncompressed bytes; a damaged or truncated file is a one-line DataError
        (gzip's BadGzipFile is an OSError; a .gz cut short raises EOFError)."""
        try:
            return self.stream.read(size)
        except self.errors as e:
            raise DataError(f"{self.path}: cannot read it ({type(e).__name__}: {e}); the file is "
                            "truncated, damaged or not the format its name says") from None

    def disk_position(self) -> int:
        return self.raw.tell()

    def close(self) -> None:
        if self.stream is not self.raw:
            self.stream.close()
        self.raw.close()


class _ZstdFrames:
    """The uncompressed bytes of a .zst file, frame after frame (as `zstd -d` reads concatenated
    frames). A file that ends inside a frame raises EOFError: python-zstandard's stream_reader
    returns what it had instead, so a cut download would lose its tail (or, cut inside a line,
    report malformed JSON) with no word of the truncation. Each read feeds `ZSTD_INPUT_BYTES` of
    the file, so what it returns stays small (a compressed block is at most 128 KiB of text)."""

    def __init__(self, raw: BinaryIO, context) -> None:
        self.raw, self.context = raw, context
        self.frame = None  # the decompressor of the frame being read; None between frames
        self.input = b""  # bytes of the file read but not yet fed

    def read(self, size: int) -> bytes:  # size: any amount suits read_blocks
        while True:
            if not self.input:
                self.input = self.raw.read(ZSTD_INPUT_BYTES)
                if not self.input:
                    if self.frame is not None:
                        raise EOFError("the file ends inside a zstd frame")
                    return b""
            if self.frame is None:
                self.frame = self.context.decompressobj()
            out = self.frame.decompress(self.input)
            self.input = b""
            if self.frame.eof:  # the frame is complete; what follows starts the next one
                self.input, self.frame = self.frame.unused_data, None
            if out:
                return out

    def close(self) -> None:
        pass


def _count_lines_before(path: str, offset: int) -> int:
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            chunk = f.read(min(offset, 1 << 24))
            if not chunk:
                break
            count += chunk.count(b"\n")
            offset -= len(chunk)
    return count


def read_blocks(piece: Piece, block_bytes: int = 1 << 20) -> Iterator[Block]:
    """Blocks of whole lines of one piece, in order, about `block_bytes` each."""
    source = _Source(piece.path)
    try:
        line = 1
        if piece.start:
            line += _count_lines_before(piece.path, piece.start)
            source.raw.seek(piece.start - 1)
            if source.raw.read(1) != b"\n":  # inside a line: it belongs to the previous piece
                line += source.raw.readline().count(b"\n")
        limit = None if piece.end is None else piece.end
        carry: list[bytes] = []  # the start of an unfinished line, in chunks (joined once)
        position = source.disk_position()
        while True:
            if limit is not None and source.raw.tell() >= limit:
                # finish the line that began before the limit, then stop
                data = b"".join(carry)
                if data and not data.endswith(b"\n"):
                    data += source.raw.readline()
                if data:
                    yield Block(piece.path, line, data, limit - position)
                return
            size = block_bytes if limit is None else min(block_bytes, limit - source.raw.tell())
            chunk = source.read(size)
            if not chunk:
                if carry:
                    yield Block(piece.path, line, b"".join(carry),
                                source.disk_position() - position)
                return
            if b"\n" not in chunk:  # a line longer than a block: no quadratic re-joining
                carry.append(chunk)
                continue
            data = b"".join([*carry, chunk])
            cut = data.rfind(b"\n") + 1
            block, carry = data[:cut], [data[cut:]] if cut < len(data) else []
            now = source.disk_position()
            yield Block(piece.path, line, block, now - position)
            position = now
            line += block.count(b"\n")
    finally:
        source.close()


def split_pieces(paths: list[str], partitions: int) -> list[list[Piece]]:
    """Divide the inputs, in order, into up to `partitions` groups of about equal size on disk.
    When there are fewer files than partitions, plain files are cut into byte ranges."""
    sizes = {p: os.path.getsize(p) for p in paths}
    pieces = [Piece(p) for p in paths]
    if 0 < len(paths) < partitions:
        per_file = -(-partitions // len(paths))
        pieces = []
        for p in paths:
            if is_compressed(p) or p.endswith(TABLE_SUFFIXES) or sizes[p] == 0:
                pieces.append(Piece(p))
                continue
            bounds = [sizes[p] * i // per_file for i in range(per_file + 1)]
            pieces += [Piece(p, a, b if b < sizes[p] else None)
                       for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    total = max(sum(sizes.values()), 1)
    groups: list[list[Piece]] = [[] for _ in range(partitions)]
    done = 0
    for piece in pieces:  # each piece goes to the group its middle byte falls in
        size = (sizes[piece.path] if piece.end is None else piece.end) - piece.start
        groups[min(partitions - 1, int((done + size / 2) * partitions / total))].append(piece)
        done += size
    return [g for g in groups if g]


def json_problem(e: json.JSONDecodeError) -> str:
    """What json.loads says, as a clause: "invalid control character at column 23" (its own
    message ends in "at" and leaves the place to a suffix; the file line is named beside it)."""
    what = e.msg.removesuffix(" at")
    return f"{what[:1].lower()}{what[1:]} at column {e.colno}"


def _utf8_clean(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def unicode_clean(value) -> bool:
    """Whether the strings of a JSON value are valid Unicode: JSON's escapes can carry a lone
    surrogate ("\\ud800"), which UTF-8 cannot hold and no tokenizer takes."""
    return _utf8_clean(value if isinstance(value, str) else json.dumps(value, ensure_ascii=False))


def parse_lines(
    block: Block, keys: list[str], skip_bad: bool, skipped: Counter,
    check: Callable[[str], str | None] | None = None,
) -> list[list[str]]:
    """The texts of `keys` for each good line of the block: [key][document].

    A bad line raises DataError naming file and line, or with `skip_bad` is counted in `skipped`
    by reason and left out. Blank lines are ignored. `check(text)`, when given, says why a text
    cannot be tokenized (TOO_LONG), or None.
    """
    texts: list[list[str]] = [[] for _ in keys]
    for number, raw in enumerate(io.BytesIO(block.data), block.first_line):
        if not raw.strip():
            continue
        reason, detail = None, ""
        try:
            line = raw.decode("utf-8")
            record = json.loads(line)
        except UnicodeDecodeError as e:
            reason, detail = BAD_UTF8, f"byte {e.start}"
        except json.JSONDecodeError as e:
            reason, detail = MALFORMED, json_problem(e)
        if reason is None and not isinstance(record, dict):
            reason, detail = NOT_OBJECT, type(record).__name__
        values = []
        if reason is None:
            for key in keys:
                value = record.get(key)
                if key not in record:
                    reason, detail = MISSING_KEY, repr(key)
                elif not isinstance(value, str):
                    reason, detail = NOT_STRING, f"{type(value).__name__} for {key!r}"
                elif ("\\ud" in line or "\\uD" in line) and not _utf8_clean(value):
                    reason, detail = BAD_UTF8, f"lone surrogate escape in {key!r}"
                elif check is not None and (problem := check(value)):
                    reason, detail = TOO_LONG, f"{key!r}: {problem}"
                if reason:
                    break
                values.append(value)
        if reason is not None:
            if not skip_bad:
                raise DataError(
                    f"{block.path}:{number}: {reason} ({detail}); fix the line or pass "
                    "--skip-bad-lines"
                )
            skipped[reason] += 1
            continue
        for column, value in zip(texts, values):
            column.append(value)
    return texts
