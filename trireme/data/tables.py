"""Parquet files and `datasets` save_to_disk folders as preprocessing input, read with pyarrow.

A Parquet file is read by record batches of the chosen columns (`--json-keys` names the columns),
about a megabyte of text each, so memory stays flat whatever the file size. A folder written by
`datasets.Dataset.save_to_disk` holds `state.json` (its `_data_files` list the shards in order)
and the shards as Arrow IPC stream files; those are memory-mapped and read batch by batch. The
documents then take the same path as JSONL lines, so the output is byte-identical to that of the
equivalent JSONL. A column that is missing or does not hold strings stops the run before anything
is tokenized; a null in a row is a bad row (named by file and 0-based row number), skippable with
--skip-bad-lines like a bad JSONL line.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trireme.data.jsonl import BAD_UTF8, NOT_STRING, TABLE_SUFFIXES, TOO_LONG
from trireme.errors import DataError


@dataclass
class TableBlock:
    path: str
    first_row: int  # 0-based number of the batch's first row in its file
    batch: Any  # a pyarrow.RecordBatch of the chosen columns
    disk_bytes: int  # bytes of the file this batch accounts for (for progress)
    input_bytes: int  # bytes of text in the batch

    def where(self) -> str:
        return f"{self.path} (rows from {self.first_row})"


def is_table(path: str) -> bool:
    return path.endswith(TABLE_SUFFIXES)


def _pyarrow():
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise DataError("reading Parquet or Arrow input needs the 'pyarrow' package: "
                        "pip install pyarrow") from None
    return pyarrow


def _open_arrow(path: str):
    """A reader of an Arrow IPC file (the stream format `datasets` writes, or the file format)."""
    pa = _pyarrow()
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_stream(source)
    except pa.ArrowInvalid:
        try:
            file_reader = pa.ipc.open_file(source)
        except pa.ArrowInvalid as e:
            raise DataError(f"{path}: not an Arrow IPC file ({str(e).splitlines()[0]})") from None
        return file_reader.to_reader() if hasattr(file_reader, "to_reader") else file_reader


def _schema(path: str):
    pa = _pyarrow()
    if path.endswith(".arrow"):
        return _open_arrow(path).schema
    try:
        return pa.parquet.read_schema(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a Parquet file ({str(e).splitlines()[0]})") from None


def check_columns(path: str, keys: list[str]) -> None:
    """DataError unless every key is a column of strings in the file."""
    pa = _pyarrow()
    schema = _schema(path)
    for key in keys:
        if key not in schema.names:
            raise DataError(f"{path}: no column {key!r} (columns: {', '.join(schema.names)}); "
                            "choose the text columns with --json-keys")
        kind = schema.field(key).type
        if pa.types.is_dictionary(kind):
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or getattr(pa.types, "is_string_view", lambda _: False)(kind)):
            raise DataError(f"{path}: column {key!r} holds {kind}, not text (strings)")


def dataset_folder_files(path: str) -> list[str]:
    """The Arrow shards of a `datasets` save_to_disk folder, in order."""
    if os.path.isfile(os.path.join(path, "dataset_dict.json")):
        with open(os.path.join(path, "dataset_dict.json")) as f:
            splits = json.load(f).get("splits", [])
        raise DataError(f"input {path!r} is a datasets DatasetDict folder (splits: "
                        f"{', '.join(splits)}); give one split's folder, e.g. "
                        f"{os.path.join(path, splits[0] if splits else 'train')}")
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        files = [os.path.join(path, d["filename"]) for d in state["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataError(f"input {path!r}: unreadable datasets state.json ({e})") from None
    if state.get("_indices"):
        raise DataError(f"input {path!r}: the dataset has an indices mapping; save it with "
                        "flatten_indices() first")
    for file in files:
        if not os.path.isfile(file):
            raise DataError(f"input {path!r}: {os.path.basename(file)} listed in state.json "
                            "is missing")
    return files


def _parquet_batches(path: str, keys: list[str], block_bytes: int):
    pa = _pyarrow()
    try:
        parquet = pa.parquet.ParquetFile(path, buffer_size=1 << 20)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a Parquet file ({str(e).splitlines()[0]})") from None
    meta = parquet.metadata
    text_bytes = sum(rg.column(c).total_uncompressed_size for r in range(meta.num_row_groups)
                     for rg in [meta.row_group(r)] for c in range(rg.num_columns)
                     if rg.column(c).path_in_schema in keys)
    rows = max(1, block_bytes * meta.num_rows // max(1, text_bytes))
    return parquet.iter_batches(batch_size=rows, columns=keys, use_threads=False), meta.num_rows


def _arrow_batches(path: str, keys: list[str], block_bytes: int):
    reader = _open_arrow(path)
    batches = (b.select(keys) for b in reader)

    def sliced():
        for batch in batches:
            per_row = max(1, batch.nbytes // max(1, batch.num_rows))
            step = max(1, block_bytes // per_row)
            for start in range(0, batch.num_rows, step):
                yield batch.slice(start, step)
    return sliced(), None


def read_table_blocks(path: str, keys: list[str], block_bytes: int = 1 << 20
                      ) -> Iterator[TableBlock]:
    """Batches of about `block_bytes` of text of the `keys` columns, in row order."""
    check_columns(path, keys)
    make = _arrow_batches if path.endswith(".arrow") else _parquet_batches
    batches, _ = make(path, keys, block_bytes)
    size, row, done = os.path.getsize(path), 0, 0
    for batch in batches:
        if batch.num_rows == 0:
            continue
        text = sum(batch.column(k).nbytes for k in keys)
        done_now = min(size, done + text)
        yield TableBlock(path, row, batch, done_now - done, text)
        row, done = row + batch.num_rows, done_now


_UNDECODABLE = object()


def _column_values(column) -> list:
    """Python strings of an Arrow column (None for null, _UNDECODABLE for invalid UTF-8)."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        values = []
        for i in range(len(column)):
            try:
                values.append(column[i].as_py())
            except UnicodeDecodeError:
                values.append(_UNDECODABLE)
        return values


def parse_rows(block: TableBlock, keys: list[str], skip_bad: bool, skipped: Counter,
               check: Callable[[str], str | None] | None = None) -> list[list[str]]:
    """The texts of `keys` for each good row of the batch: [key][document] (see parse_lines)."""
    columns = [_column_values(block.batch.column(k)) for k in keys]
    texts: list[list[str]] = [[] for _ in keys]
    for offset, values in enumerate(zip(*columns)):
        reason = detail = None
        for key, value in zip(keys, values):
            if value is None:
                reason, detail = NOT_STRING, f"null for {key!r}"
            elif value is _UNDECODABLE:
                reason, detail = BAD_UTF8, f"in {key!r}"
            elif check is not None and (problem := check(value)):
                reason, detail = TOO_LONG, f"{key!r}: {problem}"
            if reason:
                break
        if reason is not None:
            if not skip_bad:
                raise DataError(f"{block.path}: row {block.first_row + offset}: {reason} "
                                f"({detail}); fix the row or pass --skip-bad-lines")
            skipped[reason] += 1
            continue
        for column, value in zip(texts, values):
            column.append(value)
    return texts
