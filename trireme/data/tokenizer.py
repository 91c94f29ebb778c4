"""Tokenizers: text <-> token ids, with an end-of-document id (`eod`) that separates documents."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from pathlib import Path

from trireme.data.indexed import temporary_path
from trireme.errors import ConfigError, DataError

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files, tried in this order.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")


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


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` run by the `tokenizers` library."""

    def __init__(self, path: str | os.PathLike[str], eod_token: str | None = None) -> None:
        from tokenizers import Tokenizer as _RustTokenizer

        self.path = str(path)
        if not os.path.isfile(self.path):
            raise DataError(f"tokenizer file {self.path!r} not found")
        try:
            self._tok = _RustTokenizer.from_file(self.path)
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise DataError(f"{self.path}: not a valid tokenizer.json ({first_line})") from None
        candidates = (eod_token,) if eod_token else EOD_CANDIDATES
        ids = [self._tok.token_to_id(t) for t in candidates]
        found = [i for i in ids if i is not None]
        if not found:
            raise DataError(
                f"{self.path}: no end-of-document token (looked for {', '.join(candidates)})"
            )
        self.eod = found[0]
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"


def load_tokenizer(spec: str) -> Tokenizer:
    """`"bytes"`, a tokenizer.json path, or a directory holding a tokenizer.json."""
    if spec == "bytes":
        return ByteTokenizer()
    if not spec:
        raise DataError(
            "data.tokenizer is empty: give 'bytes' or a tokenizer.json path "
            "(empty only works with the embedded corpus)"
        )
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise DataError(
            f"data.tokenizer {spec!r}: {path} not found; give 'bytes' or a tokenizer.json path"
        )
    return HFTokenizer(path)


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
