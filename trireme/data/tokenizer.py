"""Tokenizers: text <-> token ids, with an end-of-document id (`eod`) that separates documents.

One interface (`encode`, `encode_batch`, `decode`, `eod`, `vocab_size`) over six kinds:

    hf             a Hugging Face tokenizer.json (or a folder holding one)
    gpt2           GPT-2's vocab.json + merges.txt (a folder holding both, or either file)
    sentencepiece  a SentencePiece .model file (needs the `sentencepiece` package)
    tiktoken       a tiktoken BPE file: base64 token and rank per line (needs `tiktoken`)
    bytes          UTF-8 bytes 0-255, eod 256; no file
    null           the text is whitespace-separated integer ids; `null:N` has ids 0..N-1, eod N

`load_tokenizer(spec)` takes `bytes`, `null:N`, a path (the kind is inferred from the file) or
`kind:path`. The file-backed kinds live in `tokenizer_formats.py`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from trireme.data import tokenizer_formats
from trireme.data.indexed import temporary_path
from trireme.data.tokenizer_base import (  # noqa: F401  (the public names of this module)
    EOD_CANDIDATES,
    EOD_TOKEN,
    KINDS,
    ByteTokenizer,
    HFTokenizer,
    NullTokenizer,
    Tokenizer,
)
from trireme.errors import ConfigError, DataError

_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")


def _sniff_model_file(path: Path) -> str:
    """A `.model` file is SentencePiece (protobuf) or tiktoken (text: base64 and rank per line)."""
    with open(path, "rb") as f:
        first = f.readline(4096)
    if _TIKTOKEN_LINE.match(first.rstrip(b"\n")):
        return "tiktoken"
    if first[:1] == b"\n":  # a SentencePiece ModelProto begins with its pieces (field 1)
        return "sentencepiece"
    raise DataError(f"{path} is not a tokenizer file (tokenizer.json, vocab.json + merges.txt, "
                    "a SentencePiece .model or a tiktoken file)")


def infer_kind(path: Path) -> tuple[str, Path]:
    """The tokenizer kind of a file or folder, and the file to load."""
    if path.is_dir():
        for name, kind in (("tokenizer.json", "hf"), ("vocab.json", "gpt2")):
            if (path / name).is_file():
                return kind, path / name
        for name in ("tokenizer.model", "spm.model"):
            if (path / name).is_file():
                return _sniff_model_file(path / name), path / name
        found = sorted(path.glob("*.tiktoken")) or sorted(path.glob("*.model"))
        if found:
            return infer_kind(found[0])
        raise DataError(
            f"tokenizer folder {str(path)!r} holds no tokenizer.json, vocab.json + merges.txt, "
            "tokenizer.model or *.tiktoken"
        )
    name = path.name
    if name == "merges.txt" or (name.endswith(".json") and (path.parent / "merges.txt").is_file()
                                and name == "vocab.json"):
        return "gpt2", path.parent / "vocab.json"
    if name.endswith(".json"):
        return "hf", path
    if name.endswith(".tiktoken"):
        return "tiktoken", path
    if name.endswith(".model"):
        return _sniff_model_file(path), path
    with open(path, "rb") as f:
        head = f.read(1).lstrip()
    return ("hf", path) if head == b"{" else (_sniff_model_file(path), path)


def file_backed(spec: str) -> bool:
    """Whether a tokenizer spec names files (not `bytes`, `null:N` or empty)."""
    return bool(spec) and spec != "bytes" and spec != "null" and not spec.startswith("null:")


def resolve_tokenizer(spec: str, name: str = "data.tokenizer") -> tuple[str, Path]:
    """The kind and the file of a file-backed spec (a path, kind inferred, or `kind:path`).
    `name` is what the user gave it as (a config key or a flag), for the not-found error."""
    kind, _, rest = spec.partition(":")
    if kind in KINDS and rest:
        path = Path(rest)
        if not path.exists():
            raise DataError(f"{name} {spec!r}: {path} not found")
        if path.is_dir() or kind == "gpt2":
            inferred, path = infer_kind(path)
            if kind == "gpt2" and inferred != "gpt2":
                path = path.parent / "vocab.json"
        return kind, path
    path = Path(spec)
    if not path.exists():
        raise DataError(
            f"{name} {spec!r}: {path} not found; give 'bytes', 'null:N', a tokenizer.json, "
            "vocab.json + merges.txt, a SentencePiece .model, a tiktoken file, or kind:path"
        )
    return infer_kind(path)


def absolute_spec(spec: str) -> str:
    """The spec with its path made absolute (so it still works from another directory)."""
    if not file_backed(spec):
        return spec
    kind, _, rest = spec.partition(":")
    if kind in KINDS and rest:
        return f"{kind}:{Path(rest).resolve()}"
    return str(Path(spec).resolve())


# The name each file of a kind gets in a copy: a folder of these loads as the same tokenizer.
COPY_NAMES = {"hf": "tokenizer.json", "sentencepiece": "tokenizer.model",
              "tiktoken": "tokenizer.tiktoken"}


def tokenizer_files(spec: str, name: str = "data.tokenizer") -> dict[str, Path]:
    """The files of a tokenizer, by the name a copy keeps each under; {} for bytes and null:N."""
    if not file_backed(spec):
        return {}
    kind, path = resolve_tokenizer(spec, name)
    if kind == "gpt2":
        return {"vocab.json": path, "merges.txt": path.parent / "merges.txt"}
    return {COPY_NAMES[kind]: path}


def load_tokenizer(spec: str, fast: bool = False, name: str = "data.tokenizer") -> Tokenizer:
    """`bytes`, `null:N`, a tokenizer path (kind inferred) or `kind:path` (kinds: see KINDS).

    `fast` lets a byte-level BPE tokenizer.json encode with tiktoken (see HFTokenizer). `name`
    is what the user gave the spec as (a config key or a flag), for the errors.
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "null" or spec.startswith("null:"):
        size = spec.partition(":")[2]
        if not size.isdigit():
            raise DataError(
                f"{name} {spec!r}: the null tokenizer needs its number of ids, as null:N"
            )
        return NullTokenizer(int(size))
    if not spec:
        raise DataError(
            f"{name} is empty: give 'bytes' or a tokenizer path "
            "(empty only works with the embedded corpus)"
        )
    kind, path = resolve_tokenizer(spec, name)
    if kind == "hf":
        return HFTokenizer(path, fast=fast)
    if kind == "gpt2":
        return tokenizer_formats.gpt2_tokenizer(path, fast=fast)
    if kind == "sentencepiece":
        return tokenizer_formats.SentencePieceTokenizer(path)
    return tokenizer_formats.TiktokenTokenizer(path)


def train_bpe(
    texts: Iterable[str], vocab_size: int, output_path: str | os.PathLike[str],
    special_tokens: Sequence[str] = (),
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) with `<|endoftext|>` as id 0 and `special_tokens`
    (e.g. a vision model's "<image>") as ids 1, 2, ...; save it as JSON.

    Byte-level means every string round-trips: unseen characters fall back to their UTF-8 bytes.
    """

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ConfigError(
            f"vocab size {vocab_size} is too small for a byte-level BPE "
            f"(at least {len(alphabet) + 1})"
        )
    tok = _RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOD_TOKEN, *(t for t in special_tokens if t != EOD_TOKEN)],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    output_path = Path(output_path)
    output_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary_path(output_path)
    try:
        tok.save(tmp)
        os.replace(tmp, output_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return HFTokenizer(output_path, eod_token=EOD_TOKEN)
