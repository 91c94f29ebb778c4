"""Data commands: `trireme preprocess`, `trireme data merge|inspect`, `trireme tokenizer train`.

Each `*_main(argv)` returns an exit status; a TriremeError becomes a one-line error and exit 2
(see trireme/cli.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from trireme.data.conversations import (
    chat_format_for,
    merged_chat_marker,
    preprocess_chat,
    write_chat_marker,
)
from trireme.data.indexed import IndexedDataset, check_writable
from trireme.data.jsonl import Piece, parse_lines, read_blocks
from trireme.data.multimodal import IMAGES_SUFFIX, is_multimodal, preprocess_multimodal
from trireme.data.preprocess import PreprocessOptions, merge_datasets, preprocess
from trireme.data.tokenizer import load_tokenizer, train_bpe
from trireme.data.tokenizer_mark import check_mark, merged_mark, tokenizer_mark, write_mark
from trireme.errors import ConfigError, DataError


@contextmanager
def _terminate_interrupts():
    """SIGTERM (`kill`, a scheduler's time limit) stops a data command as Ctrl-C does: a
    KeyboardInterrupt, so the files being written are removed and the workers stopped. By
    default it ended the process at once, leaving hidden temporary files beside the output."""
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def preprocess_main(argv: list[str]) -> int:
    with _terminate_interrupts():
        return _preprocess(argv)


def _preprocess(argv: list[str]) -> int:

    parser = argparse.ArgumentParser(
        prog="trireme preprocess",
        description="Tokenize JSONL (plain, .gz, .zst), Parquet, or datasets save_to_disk folders "
        "into Megatron .bin/.idx datasets, one per key: {prefix}_{key}_document (or _sentence).",
    )
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help="JSONL or Parquet files, or datasets save_to_disk folders")
    parser.add_argument("--output-prefix", required=True, metavar="P")
    parser.add_argument("--tokenizer", required=True, metavar="TOK",
                        help="a tokenizer path (kind inferred), kind:path, bytes or null:N")
    parser.add_argument("--json-keys", nargs="+", default=["text"], metavar="KEY",
                        help="JSON keys, or Parquet / Arrow columns, holding the text")
    parser.add_argument("--append-eod", action="store_true",
                        help="end every non-empty document with the end-of-document id")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="tokenizing processes (default: all cores)")
    parser.add_argument("--split-sentences", action="store_true",
                        help="one sequence per sentence (output named _sentence)")
    parser.add_argument("--partitions", type=int, default=1, metavar="K",
                        help="write K parts that a rerun reuses, then merge them")
    parser.add_argument("--skip-bad-lines", action="store_true",
                        help="skip malformed lines (counted per reason) instead of stopping")
    parser.add_argument("--engine", choices=["auto", "hf"], default="auto",
                        help="auto: encode byte-level BPE tokenizer.json files with tiktoken "
                        "when installed (same ids, faster); hf: always the tokenizers library")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--images", action="store_true",
                        help="multimodal JSONL ({image, text} or {image, conversations}): write "
                        "P.bin/.idx and P.images.npy (docs/data.md, 'Multimodal samples')")
    parser.add_argument("--image-size", type=int, default=224, metavar="S",
                        help="with --images: resize every image to S x S (model.vision_image_size)")
    parser.add_argument("--chat", action="store_true",
                        help="chat JSONL ({messages} or {conversations}) for fine-tuning: write "
                        "P.bin/.idx and P.chat.json, the prompts marked to have no loss "
                        "(docs/data.md, 'Chat data')")
    parser.add_argument("--chat-template", default="auto", metavar="T",
                        help="with --chat: auto (the tokenizer folder's chat template, else "
                        "plain), plain (what trireme serve uses without one), or a .jinja file")
    args = parser.parse_args(argv)
    if args.chat:
        tokenizer = load_tokenizer(args.tokenizer, name="--tokenizer")
        chat = chat_format_for(args.tokenizer, args.chat_template, tokenizer)
        report = preprocess_chat(args.input, args.output_prefix, tokenizer, chat,
                                 args.skip_bad_lines)
        write_mark(args.output_prefix, tokenizer_mark(tokenizer, args.tokenizer))
        print(f"{report.summary(args.output_prefix)} (chat template: {chat.source})")
        return 0
    if args.images:
        if args.image_size < 1:
            raise ConfigError(f"--image-size {args.image_size} must be at least 1")
        tokenizer = load_tokenizer(args.tokenizer, name="--tokenizer")
        report = preprocess_multimodal(args.input, args.output_prefix, tokenizer,
                                       args.image_size, args.skip_bad_lines)
        write_mark(args.output_prefix, tokenizer_mark(tokenizer, args.tokenizer))
        print(report.summary(args.output_prefix))
        return 0
    options = PreprocessOptions(
        inputs=args.input, output_prefix=args.output_prefix, tokenizer=args.tokenizer,
        json_keys=args.json_keys, append_eod=args.append_eod, workers=args.workers,
        split_sentences=args.split_sentences, partitions=args.partitions,
        skip_bad_lines=args.skip_bad_lines, engine=args.engine, progress=not args.no_progress,
    )
    report = preprocess(options)
    # the mark with the tokenizer as training loads it (preprocess may encode with tiktoken)
    mark = tokenizer_mark(load_tokenizer(args.tokenizer, name="--tokenizer"), args.tokenizer)
    for prefix in report.outputs:
        write_mark(prefix, mark)
    print(report.summary())
    return 0


def data_main(argv: list[str]) -> int:
    with _terminate_interrupts():
        return _data(argv)


def _data(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trireme data", description="Dataset tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    merge = sub.add_parser("merge", help="join datasets (documents in the order given)")
    merge.add_argument("--input", nargs="+", required=True, metavar="PREFIX")
    merge.add_argument("--output-prefix", required=True, metavar="P")
    inspect = sub.add_parser("inspect", help="counts, dtype, token statistics, a decoded sample")
    inspect.add_argument("prefix")
    inspect.add_argument("--tokenizer", default="", help="decode the sample with this tokenizer")
    inspect.add_argument("--document", type=int, default=0, help="which document to show")
    inspect.add_argument("--chars", type=int, default=500, help="characters of the sample")
    args = parser.parse_args(argv)
    if args.command == "merge":
        check_writable(args.output_prefix, "--output-prefix")
        mark = merged_mark(args.input)  # before writing: datasets of two tokenizers stop here
        chat = merged_chat_marker(args.input)  # and chat mixed with text
        _check_no_images(args.input)
        merged = merge_datasets(args.input, args.output_prefix)
        write_mark(args.output_prefix, mark)  # (None: removes an earlier dataset's)
        write_chat_marker(args.output_prefix, chat)
        print(f"trireme: wrote {merged.prefix}.bin / .idx: {merged.num_documents:,} documents, "
              f"{len(merged):,} sequences, {merged.num_tokens:,} {merged.dtype} tokens")
        return 0
    print(inspect_dataset(args.prefix, args.tokenizer, args.document, args.chars))
    return 0


def _check_no_images(prefixes: list[str]) -> None:
    for prefix in prefixes:
        if is_multimodal(prefix):
            raise DataError(f"merge: {prefix!r} is multimodal data; merge joins token ids only "
                            f"and would drop its {IMAGES_SUFFIX}: preprocess the JSONL files "
                            "together instead")


def inspect_dataset(prefix: str, tokenizer: str = "", document: int = 0, chars: int = 500) -> str:
    """A human-readable summary of a dataset (what `trireme data inspect` prints)."""
    if chars < 0:
        raise ConfigError(f"--chars {chars} must not be negative")
    ds = IndexedDataset(prefix, name="dataset")
    starts = ds.document_indices
    tokens_before = np.concatenate([[0], np.cumsum(ds.sequence_lengths, dtype=np.int64)])
    doc_tokens = tokens_before[starts[1:]] - tokens_before[starts[:-1]]
    lines = [
        f"dataset    {ds.prefix}",
        f"dtype      {ds.dtype} ({ds.dtype.itemsize} bytes per token)",
        f"documents  {ds.num_documents:,} ({int(np.count_nonzero(doc_tokens == 0)):,} empty)",
        f"sequences  {len(ds):,}",
        f"tokens     {ds.num_tokens:,} ({os.path.getsize(ds.prefix + '.bin') / 1e6:,.1f} MB)",
    ]
    if ds.num_documents:
        q = np.percentile(doc_tokens, [50, 90, 99])
        lines.append(
            f"per doc    min {doc_tokens.min():,}  mean {doc_tokens.mean():,.1f}  median "
            f"{q[0]:,.0f}  p90 {q[1]:,.0f}  p99 {q[2]:,.0f}  max {doc_tokens.max():,}"
        )
    if ds.num_tokens:
        limit = 1 << 27  # beyond this, a strided sample keeps inspect to a few seconds
        sample = ds.tokens if ds.num_tokens <= limit else ds.tokens[:: -(-ds.num_tokens // limit)]
        if np.issubdtype(ds.dtype, np.integer) and int(sample.min()) >= 0:
            counts = np.bincount(sample)
            ids = np.nonzero(counts)[0]
            counts = counts[ids]
        else:
            ids, counts = np.unique(sample, return_counts=True)
        scope = "" if sample.size == ds.num_tokens else f" (in a sample of {sample.size:,})"
        top = ", ".join(f"{int(i)} x{int(c):,}" for i, c in
                        sorted(zip(ids, counts), key=lambda x: -x[1])[:5])
        lines.append(f"token ids  min {int(ids[0])}  max {int(ids[-1])}  distinct "
                     f"{ids.size:,}{scope}; most frequent: {top}")
    if not 0 <= document < max(ds.num_documents, 1):
        raise ConfigError(f"--document {document}: the dataset has documents 0 to "
                          f"{ds.num_documents - 1:,}")
    if doc_tokens.size and doc_tokens[document]:
        first, last = int(starts[document]), int(starts[document + 1])
        ids = np.concatenate([ds[i] for i in range(first, last)])
        if tokenizer:
            tok = load_tokenizer(tokenizer, name="--tokenizer")
            check_mark(prefix, tok, tokenizer, name="--tokenizer")  # another's: wrong words
            if int(ids.max()) >= tok.vocab_size:  # unmarked data: a decoder may crash
                raise DataError(f"document {document} holds token id {int(ids.max())}, outside "
                                f"--tokenizer {tokenizer!r} (vocabulary {tok.vocab_size}); "
                                "decode with the tokenizer the data was made with")
            text = tok.decode(ids.tolist())
            lines.append(f"document {document} ({ids.size:,} tokens), decoded:")
            lines.append(text[:chars] + (" ..." if len(text) > chars else ""))
        else:
            shown = " ".join(map(str, ids[:64].tolist()))
            lines.append(f"document {document} ({ids.size:,} tokens; --tokenizer to decode): "
                         f"{shown}{' ...' if ids.size > 64 else ''}")
    return "\n".join(lines)


def _check_text_inputs(paths: list[str]) -> None:
    for path in paths:
        if os.path.isdir(path):
            raise DataError(f"input {path!r} is a directory; give JSONL or plain text files")
        if not os.path.isfile(path):
            raise DataError(f"input file {path!r} not found")


def _training_texts(paths: list[str], key: str) -> Iterator[str]:
    """Texts from JSONL files (the `key` of each line, bad lines skipped) or plain text lines."""

    for path in paths:
        stem = path.removesuffix(".gz").removesuffix(".zst").removesuffix(".zstd")
        is_json = stem.endswith((".jsonl", ".json", ".ndjson"))
        for block in read_blocks(Piece(path)):
            if is_json:
                yield from parse_lines(block, [key], True, Counter())[0]
            else:
                yield from block.data.decode("utf-8", errors="replace").splitlines()


def tokenizer_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="trireme tokenizer", description="Tokenizer tools.")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="train a byte-level BPE (GPT-2 style) with tokenizers")
    train.add_argument("--input", nargs="+", required=True, metavar="PATH",
                       help="JSONL (.jsonl, .gz, .zst) or plain text files")
    train.add_argument("--json-key", default="text", help="the key holding text in JSONL")
    train.add_argument("--vocab-size", type=int, required=True, metavar="N")
    train.add_argument("--output", required=True, metavar="DIR", help="writes DIR/tokenizer.json")
    train.add_argument("--special-tokens", nargs="+", default=[], metavar="TOKEN",
                       help="special tokens after <|endoftext|> (ids 1, 2, ...), e.g. '<image>'")
    args = parser.parse_args(argv)

    if args.vocab_size < 1:
        raise ConfigError(f"--vocab-size {args.vocab_size} must be positive")
    path = os.path.join(args.output, "tokenizer.json")
    if os.path.lexists(path):  # datasets made with it would lose the tokenizer that reads them
        raise ConfigError(f"--output {args.output} already holds a tokenizer.json; choose "
                          "another folder, or remove that file first")
    check_writable(path, "--output")
    _check_text_inputs(args.input)
    tok = train_bpe(_training_texts(args.input, args.json_key), args.vocab_size, path,
                    args.special_tokens)
    print(f"trireme: wrote {path} ({tok.vocab_size:,} tokens, end-of-document id {tok.eod})",
          file=sys.stdout)
    return 0
