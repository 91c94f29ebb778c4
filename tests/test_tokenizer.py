"""The tokenizers of trireme/data/tokenizer.py: bytes, the byte-level BPE trained by train_bpe
(round trips, the end-of-document token, determinism, long texts) and load_tokenizer's errors.
Other file formats: test_tokenizer_formats.py."""

import json

import pytest

from trireme.data.tokenizer import (
    EOD_TOKEN,
    ByteTokenizer,
    HFTokenizer,
    load_tokenizer,
    train_bpe,
)
from trireme.data.tokenizer_base import LONG_TEXT
from trireme.errors import ConfigError, DataError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "for i in range(10):\n    print(i, 'squared is', i * i)\n",
] * 20


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, wörld ✓\n\ttabs"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eod]) == text  # eod is not text
    assert (tok.vocab_size, tok.eod) == (257, 256)
    assert load_tokenizer("bytes").encode("a") == [97]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(iter(TEXTS), 300, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_bpe_round_trip_and_eod(bpe):
    assert bpe.vocab_size <= 300
    assert bpe.eod == 0 and bpe.decode([bpe.eod]) == EOD_TOKEN
    for text in TEXTS[:3] + ["unseen: ünïcödé ✓ and    spaces\r\n", ""]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert bpe.eod not in ids
    # merges were learned: common code compresses below one token per byte
    assert len(bpe.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2
    assert bpe.encode_batch(TEXTS[:2]) == [bpe.encode(t) for t in TEXTS[:2]]


def test_bpe_reloads(bpe):
    again = load_tokenizer(bpe.path)
    assert isinstance(again, HFTokenizer)
    assert (again.vocab_size, again.eod) == (bpe.vocab_size, bpe.eod)
    assert again.encode(TEXTS[0]) == bpe.encode(TEXTS[0])


def test_bpe_deterministic(bpe, tmp_path):
    other = train_bpe(TEXTS, 300, tmp_path / "tokenizer.json")
    assert open(other.path).read() == open(bpe.path).read()


def test_bpe_vocab_too_small(tmp_path):
    with pytest.raises(ConfigError, match="too small"):
        train_bpe(TEXTS, 100, tmp_path / "t.json")


def test_load_tokenizer_directory(bpe):
    import os

    assert load_tokenizer(os.path.dirname(bpe.path)).eod == bpe.eod


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="missing.json"):
        load_tokenizer(str(tmp_path / "missing.json"))
    with pytest.raises(DataError, match="data.tokenizer"):
        load_tokenizer("")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match="bad.json"):
        load_tokenizer(str(bad))
    # valid tokenizer.json without an end-of-document token
    no_eod = tmp_path / "no_eod.json"
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": None,
        "pre_tokenizer": None,
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "[UNK]": 1}, "unk_token": "[UNK]"},
    }
    no_eod.write_text(json.dumps(spec))
    with pytest.raises(DataError, match="end-of-document"):
        load_tokenizer(str(no_eod))


def test_bpe_long_texts_take_the_batch_call_with_the_same_ids(bpe, monkeypatch):
    """Past LONG_TEXT characters encode() goes through the batch call (which lets other threads
    run); the ids are the single call's."""
    text = "".join(TEXTS) * (LONG_TEXT // len("".join(TEXTS)) + 2)
    assert len(text) > LONG_TEXT
    single = bpe._tok.encode(text, add_special_tokens=False).ids
    calls = []
    batch = bpe._tok.encode_batch
    monkeypatch.setattr(bpe, "_tok", _Recording(bpe._tok, calls))
    assert bpe.encode(text) == single and calls == ["encode_batch"]
    assert bpe.encode(TEXTS[0]) == batch([TEXTS[0]], add_special_tokens=False)[0].ids
    assert calls == ["encode_batch", "encode"]


class _Recording:
    """A `tokenizers` Tokenizer that records which encode call it got."""

    def __init__(self, tok, calls: list[str]) -> None:
        self.tok, self.calls = tok, calls

    def encode(self, *args, **kwargs):
        self.calls.append("encode")
        return self.tok.encode(*args, **kwargs)

    def encode_batch(self, *args, **kwargs):
        self.calls.append("encode_batch")
        return self.tok.encode_batch(*args, **kwargs)
