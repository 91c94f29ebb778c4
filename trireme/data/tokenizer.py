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
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from trireme.data.indexed import temporary_path
from trireme.errors import ConfigError, DataError

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files, tried in this order.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
KINDS = ("hf", "gpt2", "sentencepiece", "tiktoken", "bytes", "null")
_TIKTOKEN_LINE = re.compile(rb"^[A-Za-z0-9+/]+=* \d+\r?$")


class Tokenizer(ABC):
    """Turns text into token ids and back; `eod` ends every document in the training stream."""

    vocab_size: int
    eod: int

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens are written out)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; implementations may do this in parallel."""
        return [self.encode(t) for t in texts]


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, plus the end-of-document id 256: no training, no files."""

    vocab_size = 257
    eod = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class NullTokenizer(Tokenizer):
    """Text that is already token ids, written as whitespace-separated integers.

    Ids 0..num_ids-1 are allowed; `eod` is num_ids, so `vocab_size` is num_ids + 1.
    """

    def __init__(self, num_ids: int) -> None:
        if num_ids < 1:
            raise ConfigError(f"null tokenizer: {num_ids} ids; give null:N with N >= 1")
        self.vocab_size = num_ids + 1
        self.eod = num_ids

    def encode(self, text: str) -> list[int]:
        try:
            ids = [int(word) for word in text.split()]
        except ValueError:
            bad = next(w for w in text.split() if not w.lstrip("-").isdigit())
            raise ValueError(f"null tokenizer: {bad[:20]!r} is not an integer") from None
        if ids and (min(ids) < 0 or max(ids) >= self.eod):
            bad = min(ids) if min(ids) < 0 else max(ids)
            raise ValueError(f"null tokenizer: id {bad} is outside 0..{self.eod - 1}")
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    def __repr__(self) -> str:
        return f"NullTokenizer({self.eod})"


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` run by the `tokenizers` library.

    With `fast=True`, a plain byte-level BPE (GPT-2 style; see `fast_bpe.py`) encodes with an
    equivalent tiktoken engine when the `tiktoken` package is there, about 3x faster; `fast_reason`
    says why not otherwise. Decoding always uses `tokenizers`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        eod_token: str | None = None,
        fast: bool = False,
        _tokenizer=None,
    ) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self.path = str(path)
        if _tokenizer is not None:
            self._tok = _tokenizer
        else:
            if not os.path.isfile(self.path):
                raise DataError(f"tokenizer file {self.path!r} not found")
            try:
                self._tok = _RustTokenizer.from_file(self.path)
            except Exception as e:  # the library raises a bare Exception on malformed JSON
                first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
                raise DataError(f"{self.path}: not a valid tokenizer.json ({first_line})") from None
        candidates = (eod_token,) if eod_token else EOD_CANDIDATES
        found = [i for i in (self._tok.token_to_id(t) for t in candidates) if i is not None]
        if not found:
            raise DataError(
                f"{self.path}: no end-of-document token (looked for {', '.join(candidates)})"
            )
        self.eod = found[0]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._fast = None
        self.fast_reason = "not asked for"
        if fast:
            from trireme.data.fast_bpe import tiktoken_engine

            self._fast, self.fast_reason = tiktoken_engine(self._tok.to_str())

    @property
    def fast(self) -> bool:
        """Whether encoding runs on the tiktoken engine."""
        return self._fast is not None

    def disable_fast(self) -> None:
        self._fast, self.fast_reason = None, "turned off"

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, allowed_special="all")
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        if self._fast is not None:
            return [self._fast.encode(t, allowed_special="all") for t in texts]
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def encode_reference(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids by the `tokenizers` library itself (to check the fast engine against)."""
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def _sniff_model_file(path: Path) -> str:
    """A `.model` file is SentencePiece (protobuf) or tiktoken (text: base64 and rank per line)."""
    with open(path, "rb") as f:
        first = f.readline(4096)
    return "tiktoken" if _TIKTOKEN_LINE.match(first.rstrip(b"\n")) else "sentencepiece"


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


def load_tokenizer(spec: str, fast: bool = False) -> Tokenizer:
    """`bytes`, `null:N`, a tokenizer path (kind inferred) or `kind:path` (kinds: see KINDS).

    `fast` lets a byte-level BPE tokenizer.json encode with tiktoken (see HFTokenizer).
    """
    if spec == "bytes":
        return ByteTokenizer()
    if spec == "null" or spec.startswith("null:"):
        size = spec.partition(":")[2]
        if not size.isdigit():
            raise DataError(
                f"tokenizer {spec!r}: the null tokenizer needs its number of ids, as null:N"
            )
        return NullTokenizer(int(size))
    if not spec:
        raise DataError(
            "data.tokenizer is empty: give 'bytes' or a tokenizer path "
            "(empty only works with the embedded corpus)"
        )
    kind, _, rest = spec.partition(":")
    if kind in KINDS and rest:
        path = Path(rest)
        if not path.exists():
            raise DataError(f"tokenizer {spec!r}: {path} not found")
        if path.is_dir() or kind == "gpt2":
            inferred, path = infer_kind(path)
            if kind == "gpt2" and inferred != "gpt2":
                path = path.parent / "vocab.json"
    else:
        path = Path(spec)
        if not path.exists():
            raise DataError(
                f"data.tokenizer {spec!r}: {path} not found; give 'bytes', 'null:N', a "
                "tokenizer.json, vocab.json + merges.txt, a SentencePiece .model, a tiktoken "
                "file, or kind:path"
            )
        kind, path = infer_kind(path)
    if kind == "hf":
        return HFTokenizer(path, fast=fast)
    from trireme.data import tokenizer_formats

    if kind == "gpt2":
        return tokenizer_formats.gpt2_tokenizer(path, fast=fast)
    if kind == "sentencepiece":
        return tokenizer_formats.SentencePieceTokenizer(path)
    return tokenizer_formats.TiktokenTokenizer(path)


def train_bpe(
    texts: Iterable[str], vocab_size: int, output_path: str | os.PathLike[str]
) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style) with `<|endoftext|>` as id 0 and save it as JSON.

    Byte-level means every string round-trips: unseen characters fall back to their UTF-8 bytes.
    """
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

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
        special_tokens=[EOD_TOKEN],
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
