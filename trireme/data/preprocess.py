"""`trireme preprocess`: JSONL in, Megatron `.bin/.idx` datasets out, in parallel, constant memory.

The main process reads each input in blocks of whole lines (about a megabyte) and hands them to a
pool of worker processes, at most two blocks per worker in flight, so memory stays flat whatever the
input size. A worker parses its block, tokenizes all of its documents in one call and returns numpy
arrays (tokens, sequence lengths, sequences per document) for each JSON key; the main process writes
them in input order. Per key the output is `{prefix}_{key}_document` (or `_sentence` with sentence
splitting), laid out as Megatron's preprocessing lays it out: an empty document is a document of
zero sequences, and `--append-eod` adds the end-of-document id to non-empty documents only.

With `partitions > 1` the inputs are cut into that many parts (by file, or by byte range of a plain
file); each part is written to its own finished dataset under `{prefix}.parts/`, which a rerun after
an interruption reuses, and the parts are merged into the output at the end.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import re
import shutil
import signal
import sys
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np
from tqdm import tqdm

from trireme.data.cuts import MAX_PIECE_CHARS, PIECE_CHARS, cut_bounds
from trireme.data.indexed import (
    CODE_OF_DTYPE,
    IndexedDataset,
    IndexedDatasetWriter,
    best_dtype,
    check_writable,
)
from trireme.data.jsonl import Block, Piece, parse_lines, read_blocks, split_pieces
from trireme.data.tables import (
    TableBlock,
    check_columns,
    dataset_folder_files,
    is_table,
    parse_rows,
    read_table_blocks,
)
from trireme.data.tokenizer import HFTokenizer, Tokenizer, load_tokenizer, tokenizer_files
from trireme.errors import ConfigError, DataError
from trireme.words import count_of

PR_SET_PDEATHSIG = 1  # prctl option (linux/prctl.h): a signal for this process when its parent dies
FAST_CHECK_DOCUMENTS = 64  # documents of each worker's first block checked against `tokenizers`
# A sentence ends at . ! ? (and any closing quotes or brackets) followed by whitespace, or at a
# blank line. Deliberately simple: no abbreviation list, no language model.
_SENTENCE_BREAK = re.compile(r"(?<=[.!?])[\"'\u201d\u2019)\]]*\s+|\n\s*\n")


@dataclass
class PreprocessOptions:
    inputs: list[str]
    output_prefix: str
    tokenizer: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    append_eod: bool = False
    workers: int = 1
    split_sentences: bool = False
    partitions: int = 1
    skip_bad_lines: bool = False
    engine: str = "auto"  # auto: tiktoken for a qualifying byte-level BPE; hf: tokenizers only
    block_bytes: int = 1 << 20
    piece_chars: int = PIECE_CHARS  # longer texts are tokenized in pieces (cuts.py)
    max_piece_chars: int = MAX_PIECE_CHARS  # a longer piece, or uncuttable text, is refused
    progress: bool = True


@dataclass
class PreprocessReport:
    outputs: list[str]
    documents: int = 0
    sequences: int = 0
    tokens: int = 0
    json_bytes: int = 0
    seconds: float = 0.0
    started: float = 0.0
    skipped: Counter = field(default_factory=Counter)
    engine: str = ""
    reused: list[int] = field(default_factory=list)  # documents of each part an earlier run made

    def summary(self) -> str:
        rate = self.json_bytes / max(self.seconds, 1e-9)
        lines = [
            f"trireme: {count_of(self.documents, 'document')}, "
            f"{count_of(self.sequences, 'sequence')}, {count_of(self.tokens, 'token')} from "
            f"{self.json_bytes / 1e6:,.1f} MB of input in "
            f"{self.seconds:.1f} s ({self.documents / max(self.seconds, 1e-9):,.0f} documents/s, "
            f"{rate / 1e6:.2f} MB/s; {self.engine})",
            *(f"trireme: wrote {p}.bin / .idx" for p in self.outputs),
        ]
        if self.reused:  # the counts above are this run's; the output holds these too
            lines.insert(1, f"trireme: reused {count_of(len(self.reused), 'finished part')} of "
                         f"an earlier run ({sum(self.reused):,} more documents)")
        if self.skipped:
            counts = ", ".join(f"{n:,} {reason}" for reason, n in sorted(self.skipped.items()))
            skipped = count_of(sum(self.skipped.values()), "bad line")
            lines.append(f"trireme: skipped {skipped}: {counts}")
        return "\n".join(lines)


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`, stripped; empty ones dropped."""
    return [s.strip() for s in _SENTENCE_BREAK.split(text) if s.strip()]


# ---- worker side ------------------------------------------------------------------------------

_worker: dict = {}


def _init_worker(options: PreprocessOptions, dtype: str) -> None:
    fast = options.engine == "auto"
    _worker.update(
        tokenizer=load_tokenizer(options.tokenizer, fast=fast), options=options,
        dtype=np.dtype(dtype), checked=not fast,
    )


def _init_pool_worker(options: PreprocessOptions, dtype: str) -> None:
    _die_with_parent()
    _init_worker(options, dtype)


def _die_with_parent() -> None:
    """A pool worker ends with the main process. Killed (SIGTERM, SIGKILL), the main process used to
    leave its workers waiting on their task queue forever, holding memory and its stdout / stderr
    (so `trireme preprocess ... | tee log` never ended). Ctrl-C is the main process's to handle:
    it stops the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the main process's handler, inherited
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _check_fast_engine(tokenizer: Tokenizer, texts: list[str]) -> str | None:
    """Compare the fast engine with `tokenizers` on some documents; turn it off on a difference."""
    if not isinstance(tokenizer, HFTokenizer) or not tokenizer.fast:
        return None
    sample = [t[:PIECE_CHARS] for t in texts[:FAST_CHECK_DOCUMENTS]]  # the engines, not cuts
    if tokenizer.encode_batch(sample) == tokenizer.encode_reference(sample):
        return None
    tokenizer.disable_fast()
    return "the tiktoken engine disagreed with tokenizers on a document; using tokenizers"


def _encode_long(tokenizer: Tokenizer, text: str, options: PreprocessOptions,
                 dtype: np.dtype) -> np.ndarray:
    """Ids of a long text, tokenized piece by piece where the tokenizer may be cut (cuts.py), so
    that memory stays near the size of the text rather than many times it."""
    bounds = cut_bounds(text, tokenizer.cut_at, options.piece_chars, options.max_piece_chars)
    parts = [np.asarray(tokenizer.encode(text[a:b]), dtype=dtype) for a, b in bounds]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _encode(tokenizer: Tokenizer, texts: list[str], block, options: PreprocessOptions,
            dtype: np.dtype) -> list:
    """Ids of each text: a list, or a numpy array for a text longer than `options.piece_chars`."""
    is_long = [len(t) > options.piece_chars for t in texts]
    try:
        short = iter(tokenizer.encode_batch([t for t, x in zip(texts, is_long) if not x]))
        return [_encode_long(tokenizer, t, options, dtype) if x else next(short)
                for t, x in zip(texts, is_long)]
    except ValueError as e:  # e.g. the null tokenizer on a non-integer
        raise DataError(f"{block.where()}: {e}") from None


def _length_problem(text: str) -> str | None:
    """Why a text cannot be tokenized in pieces of bounded size, or None (see cuts.py)."""
    options: PreprocessOptions = _worker["options"]
    if len(text) <= options.piece_chars:
        return None
    for part in split_sentences(text) if options.split_sentences else [text]:
        try:
            cut_bounds(part, _worker["tokenizer"].cut_at, options.piece_chars,
                       options.max_piece_chars)
        except ValueError as e:
            return str(e)
    return None


def _flatten(sequences: list, dtype: np.dtype, total: int) -> np.ndarray:
    """All sequences (lists or arrays) back to back as one array."""
    out = np.empty(total, dtype=dtype)
    position, run = 0, []
    for sequence in [*sequences, None]:
        if isinstance(sequence, list):
            run.append(sequence)
            continue
        size = sum(map(len, run))
        out[position : position + size] = np.fromiter(
            itertools.chain.from_iterable(run), dtype=dtype, count=size)
        position, run = position + size, []
        if sequence is not None:
            out[position : position + sequence.size] = sequence
            position += sequence.size
    return out


def _tokenize_column(texts: list[str], block, options: PreprocessOptions, dtype: np.dtype):
    """(tokens, sequence lengths, sequences per document) of one key's texts, as arrays."""
    tokenizer: Tokenizer = _worker["tokenizer"]
    if options.split_sentences:
        sentences = [split_sentences(t) for t in texts]
        per_doc = [len(s) for s in sentences]
        ids = _encode(tokenizer, list(itertools.chain.from_iterable(sentences)), block, options,
                      dtype)
        docs = []
        start = 0
        for n in per_doc:
            docs.append([s for s in ids[start : start + n] if len(s)])  # empty sentences dropped
            start += n
    else:
        docs = [[ids] if len(ids) else [] for ids in _encode(tokenizer, texts, block, options,
                                                            dtype)]
    if options.append_eod:
        for doc in docs:
            if doc and isinstance(doc[-1], list):
                doc[-1].append(tokenizer.eod)
            elif doc:
                doc[-1] = np.append(doc[-1], np.asarray(tokenizer.eod, dtype=dtype))
    sequences = list(itertools.chain.from_iterable(docs))
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    tokens = _flatten(sequences, dtype, int(lengths.sum()))
    counts = np.fromiter(map(len, docs), dtype=np.int64, count=len(docs))
    return tokens, lengths, counts


def _process_block(block: Block) -> dict:
    """Worker: one block of lines -> arrays per key, counts, and any error as a message."""
    options: PreprocessOptions = _worker["options"]
    skipped: Counter = Counter()
    result: dict = {"disk_bytes": block.disk_bytes, "json_bytes": block.input_bytes}
    parse = parse_rows if isinstance(block, TableBlock) else parse_lines
    try:
        texts = parse(block, options.json_keys, options.skip_bad_lines, skipped, _length_problem)
        if not _worker["checked"] and texts[0]:
            _worker["checked"] = True
            result["warning"] = _check_fast_engine(_worker["tokenizer"], texts[0])
        result["columns"] = [_tokenize_column(t, block, options, _worker["dtype"]) for t in texts]
    except DataError as e:
        result["error"] = str(e)
    result["skipped"] = skipped
    return result


# ---- main process -----------------------------------------------------------------------------


def _ordered_results(blocks, options: PreprocessOptions, dtype: np.dtype):
    """Results of `_process_block` in input order, with at most 2 blocks per worker in flight."""
    if options.workers <= 1:
        _init_worker(options, dtype.str)
        for block in blocks:
            yield _process_block(block)
        return
    with ProcessPoolExecutor(
        options.workers, mp_context=get_context("fork"), initializer=_init_pool_worker,
        initargs=(options, dtype.str),
    ) as pool:
        pending: deque = deque()
        for block in blocks:
            pending.append(pool.submit(_process_block, block))
            if len(pending) >= 2 * options.workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _progress(options: PreprocessOptions, total: int):
    if not options.progress:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc="preprocess", file=sys.stderr,
                dynamic_ncols=True, smoothing=0.1)


def output_prefixes(options: PreprocessOptions) -> list[str]:
    level = "sentence" if options.split_sentences else "document"
    return [f"{options.output_prefix}_{key}_{level}" for key in options.json_keys]


def _read(piece: Piece, options: PreprocessOptions):
    if is_table(piece.path):
        return read_table_blocks(piece.path, options.json_keys, options.block_bytes)
    return read_blocks(piece, options.block_bytes)


def _check_not_empty(counts: list[tuple[int, int]], options: PreprocessOptions,
                     report: PreprocessReport) -> None:
    """DataError when the output would be empty: (documents, tokens) per key."""
    if counts[0][0] == 0:
        skipped = sum(report.skipped.values())
        why = f"all {skipped:,} were bad and skipped" if skipped else "the input is empty"
        raise DataError(f"preprocess: no documents in {', '.join(options.inputs)}: {why}; "
                        "nothing written")
    for key, (documents, tokens) in zip(options.json_keys, counts):
        if tokens == 0:
            raise DataError(f"preprocess: all {documents:,} documents have an empty "
                            f"{key!r}; nothing written")


def _write_part(pieces: list[Piece], prefixes: list[str], options: PreprocessOptions,
                dtype: np.dtype, report: PreprocessReport, bar, whole: bool = True) -> None:
    """Tokenize the pieces into one dataset per key, finished atomically (or not at all)."""
    writers = [IndexedDatasetWriter(p, dtype) for p in prefixes]
    try:
        blocks = (b for piece in pieces for b in _read(piece, options))
        for result in _ordered_results(blocks, options, dtype):
            if "error" in result:
                raise DataError(result["error"])
            if result.get("warning") and not report.engine.endswith("(fell back)"):
                print(f"trireme: warning: {result['warning']}", file=sys.stderr)
                report.engine += " (fell back)"
            for writer, (tokens, lengths, counts) in zip(writers, result["columns"]):
                writer.add_documents(tokens, lengths, counts)
            tokens, lengths, counts = result["columns"][0]
            report.documents += counts.size
            report.sequences += sum(c[1].size for c in result["columns"])
            report.tokens += sum(c[0].size for c in result["columns"])
            report.json_bytes += result["json_bytes"]
            report.skipped += result["skipped"]
            if bar is not None:
                bar.update(result["disk_bytes"])
                seconds = max(time.perf_counter() - report.started, 1e-9)
                bar.set_postfix_str(f"{report.documents / seconds:,.0f} docs/s, "
                                    f"{report.json_bytes / seconds / 1e6:.2f} MB/s")
        if whole:
            _check_not_empty([(w.num_documents, w.num_tokens) for w in writers], options, report)
    except BaseException:
        for writer in writers:
            writer.abort()
        raise
    for writer in writers:
        writer.finalize()


def resolve_inputs(paths: list[str], keys: list[str]) -> list[str]:
    """The input files, checked: a `datasets` folder becomes its Arrow shards; Parquet and Arrow
    files must hold the key columns as strings. A one-line DataError names what is wrong."""
    if not paths:
        raise ConfigError("preprocess: no --input files")
    files = []
    for path in paths:
        if os.path.isdir(path):
            if not any(os.path.isfile(os.path.join(path, name))
                       for name in ("state.json", "dataset_dict.json")):
                raise DataError(
                    f"input {path!r} is a directory; give JSONL files (.jsonl, .jsonl.gz, "
                    ".jsonl.zst), Parquet files, or a folder written by datasets' save_to_disk"
                )
            files += dataset_folder_files(path)
        elif not os.path.isfile(path):
            raise DataError(f"input file {path!r} not found")
        else:
            files.append(path)
    for path in files:
        if is_table(path):
            check_columns(path, keys)
    return files


def preprocess(options: PreprocessOptions) -> PreprocessReport:
    """Run the whole preprocessing; returns counts and timings (printing is the caller's)."""
    inputs = resolve_inputs(options.inputs, options.json_keys)
    if options.partitions < 1 or options.workers < 0:
        raise ConfigError("preprocess: --partitions must be >= 1 and --workers >= 0")
    created = check_writable(options.output_prefix, "--output-prefix")
    tokenizer = load_tokenizer(options.tokenizer, fast=options.engine == "auto",
                               name="--tokenizer")
    dtype = best_dtype(tokenizer.vocab_size)
    fast = isinstance(tokenizer, HFTokenizer) and tokenizer.fast
    engine = "tiktoken engine" if fast else f"{type(tokenizer).__name__}"
    if isinstance(tokenizer, HFTokenizer) and not fast and options.engine == "auto":
        engine += f" (fast engine off: {tokenizer.fast_reason})"
    prefixes = output_prefixes(options)
    workers = count_of(max(options.workers, 1), "worker")
    report = PreprocessReport(prefixes, engine=f"{engine}, {workers}")
    bar = _progress(options, sum(os.path.getsize(p) for p in inputs))
    report.started = start = time.perf_counter()
    try:
        groups = split_pieces(inputs, options.partitions)
        if len(groups) == 1:
            _write_part(groups[0], prefixes, options, dtype, report, bar)
        else:
            _write_partitioned(groups, prefixes, options, dtype, report, bar)
    except BaseException:
        parts = options.output_prefix + ".parts"  # kept if it holds finished parts to reuse
        for directory in [parts, *reversed(created)]:  # the run made them; empty now
            if os.path.isdir(directory) and not os.listdir(directory):
                os.rmdir(directory)
        raise
    finally:
        if bar is not None:
            bar.close()
    report.seconds = time.perf_counter() - start
    return report


def _write_partitioned(groups, prefixes, options, dtype, report, bar) -> None:
    parts_dir = options.output_prefix + ".parts"
    os.makedirs(parts_dir, exist_ok=True)
    part_prefixes = []
    for i, pieces in enumerate(groups):
        description = json.dumps([[p.path, p.start, p.end, *file_stamp(p.path)] for p in pieces]
                                 + [options.json_keys, options.tokenizer,
                                    tokenizer_stamp(options.tokenizer), options.append_eod,
                                    options.split_sentences, dtype.str])
        marker = os.path.join(parts_dir, f"part{i}.done")
        names = [os.path.join(parts_dir, f"part{i}_{os.path.basename(p)}") for p in prefixes]
        part_prefixes.append(names)
        if os.path.isfile(marker) and Path(marker).read_text() == description:
            if bar is not None:
                bar.update(sum(os.path.getsize(p.path) if p.end is None else p.end - p.start
                               for p in pieces))
            report.reused.append(IndexedDataset(names[0]).num_documents)
            continue  # finished by an earlier, interrupted run
        _write_part(pieces, names, options, dtype, report, bar, False)  # whole=False
        with open(marker + ".tmp", "w") as f:
            f.write(description)
        os.replace(marker + ".tmp", marker)
    parts = [[IndexedDataset(name) for name in names] for names in part_prefixes]
    try:
        _check_not_empty([(sum(p[k].num_documents for p in parts),
                           sum(p[k].num_tokens for p in parts)) for k in range(len(prefixes))],
                         options, report)
    except DataError:
        shutil.rmtree(parts_dir)  # finished parts of an input that cannot give a dataset
        raise
    for k, prefix in enumerate(prefixes):
        merge_datasets([names[k] for names in part_prefixes], prefix)
    shutil.rmtree(parts_dir)


def file_stamp(path: str) -> list[int]:
    """[size, mtime in ns] of a file (a part's marker records its inputs', so a changed input is
    tokenized again rather than its old part reused); [] if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return []
    return [st.st_size, st.st_mtime_ns]


def tokenizer_stamp(spec: str) -> list[list[int]]:
    """The stamps of the tokenizer's files (none for built-in ones such as bytes)."""
    try:
        files = tokenizer_files(spec)
    except (ConfigError, DataError, OSError):
        return []
    return [file_stamp(str(path)) for _, path in sorted(files.items())]


def merge_datasets(inputs: list[str], output: str) -> IndexedDataset:
    """Join datasets, documents in the order given, into `output` (written atomically)."""
    if not inputs:
        raise ConfigError("merge: no input datasets")
    opened = [IndexedDataset(p, name="--input") for p in inputs]
    dtype = np.result_type(*(d.dtype for d in opened))  # e.g. uint16 and int32 give int32
    if dtype not in CODE_OF_DTYPE:
        raise DataError(f"merge: token dtypes {sorted({str(d.dtype) for d in opened})} have no "
                        "common Megatron dtype")
    with IndexedDatasetWriter(output, dtype) as writer:
        for dataset in opened:
            writer.append(dataset)
    return IndexedDataset(output)
