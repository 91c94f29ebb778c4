"""The tokenizer interface and the kinds that need no extra file format: bytes, null, a
Hugging Face tokenizer.json (trireme.data.tokenizer loads any kind)."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

from tokenizers import Tokenizer as _RustTokenizer

from trireme.data.cuts import hf_cut_at
from trireme.data.fast_bpe import tiktoken_engine
from trireme.errors import ConfigError, DataError

EOD_TOKEN = "<|endoftext|>"
# End-of-document tokens of common tokenizer.json files, tried in this order.
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "[SEP]")
KINDS = ("hf", "gpt2", "sentencepiece", "tiktoken", "bytes", "null")


class Tokenizer(ABC):
    """Turns text into token ids and back; `eod` ends every document in the training stream."""

    vocab_size: int
    eod: int
    # Where a long text may be cut so that its pieces tokenize to the ids of the whole (see
    # trireme/data/cuts.py): "char", "whitespace", "space", or "" (nowhere).
    cut_at: str = ""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, without any special tokens added."""

    @abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` (special tokens are written out)."""

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text; implementations may do this in parallel."""
        return [self.encode(t) for t in texts]

    def token_id(self, token: str) -> int | None:
        """The id of a special token such as "<image>", None if the vocabulary lacks it."""
        return None


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as ids 0-255, plus the end-of-document id 256: no training, no files."""

    vocab_size = 257
    eod = 256
    cut_at = "char"

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

    cut_at = "whitespace"

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


# Past this many characters HFTokenizer.encode goes through `tokenizers`' batch call, the same
# ids: its single-text call holds Python's GIL throughout (seconds for a text of megabytes: no other
# thread of the process runs), the batch call releases it.
LONG_TEXT = 1 << 16


class HFTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` run by the `tokenizers` library.

    With `fast=True`, a plain byte-level BPE (GPT-2 style; see `fast_bpe.py`) encodes with an
    equivalent tiktoken engine when the `tiktoken` package is there, measured faster; `fast_reason`
    says why not otherwise. Decoding always uses `tokenizers`.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | None,
        eod_token: str | None = None,
        fast: bool = False,
        _tokenizer=None,
    ) -> None:

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

            self._fast, self.fast_reason = tiktoken_engine(self._tok.to_str())

    @property
    def fast(self) -> bool:
        """Whether encoding runs on the tiktoken engine."""
        return self._fast is not None

    @property
    def cut_at(self) -> str:  # type: ignore[override]
        if not hasattr(self, "_cut_at"):
            self._cut_at, self.cut_reason = hf_cut_at(self._tok.to_str())
        return self._cut_at

    def disable_fast(self) -> None:
        self._fast, self.fast_reason = None, "turned off"

    def encode(self, text: str) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, allowed_special="all")
        if len(text) > LONG_TEXT:  # the batch call lets other threads run (a server's)
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
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

    def token_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r}, vocab_size={self.vocab_size}, eod={self.eod})"
