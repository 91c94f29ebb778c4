"""Tokenizer files of every kind (trireme/data/tokenizer_formats.py, fast_bpe.py): GPT-2 vocab and
merges, tiktoken, SentencePiece, null:N, the tiktoken engine against `tokenizers`, which kind a
path is, and `trireme tokenizer train`."""

import base64
import json
import sys

import pytest

from trireme.cli import main
from trireme.data.fast_bpe import byte_to_symbol, tiktoken_engine
from trireme.data.tokenizer import (
    HFTokenizer,
    NullTokenizer,
    infer_kind,
    load_tokenizer,
    train_bpe,
)
from trireme.errors import DataError

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. It's 2026; numbers 12345 and 3.14!",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
] * 10
HARD = [
    "",
    "unseen: ünïcödé ✓ and    spaces\r\n\ttabs",
    "a special <|endoftext|> inside text",
    "   leading and trailing   ",
    "emoji 🚀🚀 and CJK 漢字かな, Ωμέγα",
    "'s 're 've 'll 'd 'm quotes' and\n\n\nnewlines",
    "1234567890 ++-- ** // !!",
]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    return train_bpe(iter(TEXTS), 400, tmp_path_factory.mktemp("tok") / "tokenizer.json")


def test_fast_engine_matches_tokenizers(bpe):
    pytest.importorskip("tiktoken", reason="the fast engine needs tiktoken")
    fast = load_tokenizer(bpe.path, fast=True)
    assert fast.fast, fast.fast_reason
    assert not load_tokenizer(bpe.path).fast  # off unless asked for
    texts = TEXTS[:3] + HARD
    assert fast.encode_batch(texts) == fast.encode_reference(texts)
    assert [fast.encode(t) for t in texts] == bpe.encode_batch(texts)
    assert fast.encode("x<|endoftext|>y")[1] == fast.eod  # added tokens split out, as in HF


def test_without_tiktoken_the_reference_engine_gives_the_same_ids(bpe, monkeypatch):
    """tiktoken is a dependency, but an environment without it still tokenizes (issue 24 item 9)."""
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # `import tiktoken` raises ImportError
    tok = load_tokenizer(bpe.path, fast=True)
    assert not tok.fast and "tiktoken" in tok.fast_reason
    assert tok.encode_batch(HARD) == bpe.encode_batch(HARD)


def test_fast_engine_declines_other_models(tmp_path):
    spec = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
        "normalizer": None, "pre_tokenizer": None, "post_processor": None, "decoder": None,
        "model": {"type": "WordLevel", "vocab": {"a": 0, "</s>": 1}, "unk_token": "</s>"},
    }
    engine, reason = tiktoken_engine(json.dumps(spec))
    assert engine is None and ("WordLevel" in reason or "tiktoken" in reason)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(spec))
    tok = load_tokenizer(str(path), fast=True)
    assert not tok.fast and tok.encode("a") == [0]


def test_gpt2_vocab_and_merges(bpe, tmp_path):
    bpe._tok.model.save(str(tmp_path))  # writes vocab.json + merges.txt
    for spec in (str(tmp_path), str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"),
                 f"gpt2:{tmp_path}"):
        tok = load_tokenizer(spec)
        assert isinstance(tok, HFTokenizer)
        assert tok.eod == bpe.eod and tok.vocab_size == bpe.vocab_size
        for text in TEXTS[:3] + HARD:
            assert tok.encode(text) == bpe.encode(text)
            assert tok.decode(tok.encode(text)) == text


def write_tiktoken(bpe, path):
    symbol_to_byte = {s: b for b, s in byte_to_symbol().items()}
    vocab = json.loads(bpe._tok.to_str())["model"]["vocab"]
    lines = []
    for token, rank in sorted(vocab.items(), key=lambda kv: kv[1]):
        if token == "<|endoftext|>":
            continue
        raw = bytes(symbol_to_byte[c] for c in token)
        lines.append(f"{base64.b64encode(raw).decode()} {rank - 1}")  # ranks from 0, no gaps
    path.write_text("\n".join(lines) + "\n")
    return path


def test_tiktoken_file(bpe, tmp_path):
    pytest.importorskip("tiktoken", reason="tiktoken files need the tiktoken package")
    path = write_tiktoken(bpe, tmp_path / "tok.tiktoken")
    model = write_tiktoken(bpe, tmp_path / "tokenizer.model")  # Llama 3 names it .model
    for spec in (str(path), f"tiktoken:{path}", str(model), str(tmp_path)):
        tok = load_tokenizer(spec)
        assert type(tok).__name__ == "TiktokenTokenizer"
        assert tok.eod == bpe.vocab_size - 1 and tok.vocab_size == bpe.vocab_size
        for text in TEXTS[:3] + HARD:
            ids = tok.encode(text)
            assert tok.decode(ids) == text and tok.eod not in ids
        # a padded model's ids past the vocabulary are skipped, as HF tokenizers skip them
        assert tok.decode([*ids, tok.vocab_size, tok.vocab_size + 7]) == tok.decode(ids)
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("not base64 at all\n")
    with pytest.raises(DataError, match="bad.tiktoken:1"):
        load_tokenizer(str(bad))


def test_a_file_that_is_no_tokenizer_is_named_as_such(tmp_path):
    """A file that is no tokenizer (no extension, or a .model) was taken for SentencePiece: the
    error asked for the sentencepiece package, or said its protobuf did not parse."""
    for name in ("notes", "weights.model"):
        (tmp_path / name).write_bytes(b"garbage\x00\x01")
        with pytest.raises(DataError, match=f"{name} is not a tokenizer file"):
            load_tokenizer(str(tmp_path / name))


def test_sentencepiece_model(tmp_path):
    spm = pytest.importorskip("sentencepiece", reason="SentencePiece models need sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(t.replace("\n", " ") for t in TEXTS))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(tmp_path / "sp"), vocab_size=80, model_type="bpe",
        minloglevel=2,
    )
    for spec in (str(tmp_path / "sp.model"), f"sentencepiece:{tmp_path / 'sp.model'}"):
        tok = load_tokenizer(spec)
        assert type(tok).__name__ == "SentencePieceTokenizer"
        assert tok.vocab_size == 80 and tok.eod == 2  # </s>
        ids = tok.encode("The quick brown fox")
        assert tok.decode(ids) == "The quick brown fox"
        assert tok.encode_batch(["a b", "fox"]) == [tok.encode("a b"), tok.encode("fox")]
        # generate / serve of a model with a padded vocabulary: an IndexError traceback was
        # raised for ids past the tokenizer's
        assert tok.decode([*ids, 80, 95]) == "The quick brown fox"


def test_null_tokenizer():
    tok = load_tokenizer("null:50")
    assert isinstance(tok, NullTokenizer) and (tok.vocab_size, tok.eod) == (51, 50)
    assert tok.encode(" 3  4\n49 ") == [3, 4, 49] and tok.decode([3, 4]) == "3 4"
    for bad in ("50", "-1", "x"):
        with pytest.raises(ValueError):
            tok.encode(bad)
    with pytest.raises(DataError, match="null:N"):
        load_tokenizer("null")


def test_infer_kind_and_errors(bpe, tmp_path):
    import os

    assert infer_kind(type(tmp_path)(os.path.dirname(bpe.path)))[0] == "hf"
    with pytest.raises(DataError, match="holds no tokenizer"):
        infer_kind(tmp_path)
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(f"hf:{tmp_path / 'missing.json'}")


def test_tokenizer_train_cli(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS) + "{broken\n")
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", str(src), "--vocab-size", "300",
                 "--output", str(out)]) == 0
    assert "tokenizer.json" in capsys.readouterr().out
    tok = load_tokenizer(str(out))
    assert tok.vocab_size == 300 and tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]
    assert main(["tokenizer", "train", "--input", str(src), "--vocab-size", "10",
                 "--output", str(tmp_path / "small")]) == 2
    assert "too small" in capsys.readouterr().err


def test_tokenizer_train_keeps_an_existing_tokenizer(tmp_path, capsys):
    """Training into a folder that holds a tokenizer.json replaced it silently (the datasets
    made with it then decoded with another); it is refused and the file kept."""
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    out = tmp_path / "tok"
    args = ["tokenizer", "train", "--input", str(src), "--output", str(out), "--vocab-size"]
    assert main([*args, "300"]) == 0
    before = (out / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert main([*args, "280"]) == 2
    assert "already holds a tokenizer.json" in capsys.readouterr().err
    assert (out / "tokenizer.json").read_bytes() == before
