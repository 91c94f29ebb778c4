"""Tokenizer files other than a tokenizer.json: GPT-2 vocab + merges, SentencePiece, tiktoken.

SentencePiece and tiktoken are optional packages, imported when such a file is loaded; a missing
package is a DataError that says what to install.
"""

from __future__ import annotations

import base64
import importlib
import os
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _RustTokenizer
from tokenizers import decoders, models, pre_tokenizers

from trireme.data.fast_bpe import CL100K_PATTERN
from trireme.data.tokenizer_base import EOD_TOKEN, HFTokenizer, Tokenizer
from trireme.errors import DataError

TIKTOKEN_PATTERN = CL100K_PATTERN
LLAMA3_BASE_TOKENS = 128_000  # a tiktoken file of this size gets Llama 3's 256 special tokens
LLAMA3_NAMED = {
    0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
    7: "<|end_header_id|>", 9: "<|eot_id|>",
}


def _require(package: str, what: str):

    try:
        return importlib.import_module(package)
    except ImportError:
        raise DataError(
            f"{what} needs the '{package}' package: pip install {package}"
        ) from None


def gpt2_tokenizer(vocab_path: str | os.PathLike[str], fast: bool = False) -> HFTokenizer:
    """GPT-2's `vocab.json` + `merges.txt` (side by side) as a byte-level BPE."""

    vocab = Path(vocab_path)
    merges = vocab.parent / "merges.txt"
    for path in (vocab, merges):
        if not path.is_file():
            raise DataError(f"GPT-2 tokenizer: {path} not found (need vocab.json + merges.txt)")
    try:
        tok = _RustTokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as e:
        raise DataError(f"{vocab}: not a GPT-2 vocab.json + merges.txt ({e})") from None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if tok.token_to_id(EOD_TOKEN) is not None:
        tok.add_special_tokens([EOD_TOKEN])  # keeps its id; marks it special, as GPT-2 does
    return HFTokenizer(vocab, fast=fast, _tokenizer=tok)


def known_ids(ids: Sequence[int], vocab_size: int) -> list[int]:
    """`ids` without those past the vocabulary, which a model whose embedding is larger than its
    tokenizer (padded) can generate: skipped as Hugging Face tokenizers skip them (SentencePiece
    and tiktoken raise)."""
    return [int(i) for i in ids if 0 <= int(i) < vocab_size]


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece `.model`; `eod` is its end-of-sentence id (`</s>`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        spm = _require("sentencepiece", "a SentencePiece tokenizer")
        self.path = str(path)
        try:
            self._sp = spm.SentencePieceProcessor(model_file=self.path)
        except Exception as e:
            raise DataError(f"{self.path}: not a SentencePiece model ({e})") from None
        self.vocab_size = int(self._sp.get_piece_size())
        eod = int(self._sp.eos_id())
        if eod < 0:
            for name in (EOD_TOKEN, "</s>", "<eos>"):
                piece = int(self._sp.piece_to_id(name))
                if piece != self._sp.unk_id():
                    eod = piece
                    break
        if eod < 0:
            raise DataError(f"{self.path}: SentencePiece model without an end-of-sentence id")
        self.eod = eod

    def encode(self, text: str) -> list[int]:
        return self._sp.encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._sp.encode(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(known_ids(ids, self.vocab_size))

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r}, vocab_size={self.vocab_size})"


def read_tiktoken_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """A tiktoken BPE file: one `base64(token) rank` pair per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:
                raise DataError(
                    f"{path}:{number}: not a tiktoken BPE line (base64 token, space, rank)"
                ) from None
    if not ranks:
        raise DataError(f"{path}: empty tiktoken BPE file")
    return ranks


class TiktokenTokenizer(Tokenizer):
    """A tiktoken BPE file, split with the cl100k / Llama 3 regex.

    Special tokens follow the ranks: a file of 128,000 ranks gets Llama 3's 256 (eod is
    `<|end_of_text|>`, 128001); any other gets one, `<|endoftext|>`, as eod. Text is encoded as
    ordinary text: special-token strings inside it are not turned into special ids.
    """

    cut_at = "space"  # the cl100k regex: see trireme/data/cuts.py

    def __init__(self, path: str | os.PathLike[str]) -> None:
        tiktoken = _require("tiktoken", "a tiktoken tokenizer")
        self.path = str(path)
        ranks = read_tiktoken_ranks(path)
        base = max(ranks.values()) + 1
        if base == LLAMA3_BASE_TOKENS:
            special = {
                LLAMA3_NAMED.get(i, f"<|reserved_special_token_{i}|>"): base + i
                for i in range(256)
            }
            self.eod = base + 1
        else:
            special = {EOD_TOKEN: base}
            self.eod = base
        try:
            self._enc = tiktoken.Encoding(
                os.path.basename(self.path), pat_str=TIKTOKEN_PATTERN, mergeable_ranks=ranks,
                special_tokens=special,
            )
        except Exception as e:
            raise DataError(f"{self.path}: tiktoken refused the file ({e})") from None
        self.vocab_size = base + len(special)

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(known_ids(ids, self.vocab_size))

    def __repr__(self) -> str:
        return f"TiktokenTokenizer({self.path!r}, vocab_size={self.vocab_size})"
