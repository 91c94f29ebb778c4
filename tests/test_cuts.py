"""Long texts are tokenized in pieces (trireme/data/cuts.py): the same ids as the whole text, memory
near the size of the text, and a one-line refusal where a tokenizer cannot be cut."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as RustTokenizer

from trireme.cli import main
from trireme.data.cuts import CL100K_PATTERN, cut_bounds, hf_cut_at
from trireme.data.indexed import IndexedDataset
from trireme.data.preprocess import PreprocessOptions, preprocess
from trireme.data.tokenizer import HFTokenizer, load_tokenizer, train_bpe

# Fragments that stress the split regexes: runs and mixes of whitespace, contractions, long
# numbers, punctuation runs, non-Latin letters, a special-token string.
FRAGMENTS = ["hello", "World", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "\r\n", "'s", "'LL",
             "'", "1234567", "3.14", "!!", "...", "ünï", "日本語", "—", "<|endoftext|>", "x",
             "a1b2", " \t ", "?\n", "(", ")", "$", "\u00a0", "\u2003", "e\u0301"]


def tricky_texts(count=25, length=400, seed=0):
    rng = np.random.default_rng(seed)
    return ["".join(rng.choice(FRAGMENTS, length)) for _ in range(count)]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """A GPT-2-style byte-level BPE and a cl100k-split one, both as tokenizer.json files."""
    root = tmp_path_factory.mktemp("tok")
    corpus = tricky_texts(50, 300, seed=1)
    gpt2 = root / "gpt2" / "tokenizer.json"
    train_bpe(corpus, 400, gpt2)
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CL100K_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    cl100k = root / "cl100k" / "tokenizer.json"
    cl100k.parent.mkdir()
    tok.save(str(cl100k))
    return {"gpt2": str(gpt2), "cl100k": str(cl100k)}


def pieces_ids(tokenizer, text, piece_chars):
    bounds = cut_bounds(text, tokenizer.cut_at, piece_chars, 10**9)
    assert bounds[0][0] == 0 and bounds[-1][1] == len(text)
    assert all(a < b for a, b in bounds) and all(b == c for (_, b), (c, _) in
                                                 zip(bounds, bounds[1:]))
    return [i for a, b in bounds for i in tokenizer.encode(text[a:b])], len(bounds)


@pytest.mark.parametrize("kind", ["gpt2", "cl100k"])
@pytest.mark.parametrize("fast", [False, True])
def test_byte_level_bpe_pieces_give_the_ids_of_the_whole(tokenizers, kind, fast):
    if fast:
        pytest.importorskip("tiktoken")
    tokenizer = HFTokenizer(tokenizers[kind], fast=fast)
    assert tokenizer.cut_at == "space" and tokenizer.fast == fast
    cuts = 0
    for piece_chars in (3, 7, 20, 64):
        for text in tricky_texts():
            ids, n = pieces_ids(tokenizer, text, piece_chars)
            assert ids == tokenizer.encode(text), (piece_chars, text)
            cuts += n - 1
    assert cuts > 300  # the texts really were cut, many times


def test_bytes_and_null_tokenizers_cut_anywhere_they_split(tokenizers):
    for text in tricky_texts(5):
        ids, n = pieces_ids(load_tokenizer("bytes"), text, 13)
        assert ids == list(text.encode()) and n > 10
    numbers = " ".join(str(i) for i in range(500)).replace("7 ", "7\n\t ")
    null = load_tokenizer("null:1000")
    ids, n = pieces_ids(null, numbers, 11)
    assert ids == null.encode(numbers) and n > 50


def test_tokenizers_that_cannot_be_vouched_for_are_not_cut(tokenizers):
    spec = json.loads(open(tokenizers["gpt2"]).read())
    assert hf_cut_at(json.dumps(spec)) == ("space", "ok")
    lower = dict(spec, normalizer={"type": "Lowercase"})
    assert hf_cut_at(json.dumps(lower)) == ("", "a Lowercase normalizer")
    meta = dict(spec, pre_tokenizer={"type": "Metaspace", "replacement": "▁"})
    assert hf_cut_at(json.dumps(meta))[0] == ""
    spaced = dict(spec, added_tokens=[{"id": 0, "content": "end of text", "rstrip": False}])
    assert "whitespace" in hf_cut_at(json.dumps(spaced))[1]
    truncating = dict(spec, truncation={"max_length": 512})
    assert hf_cut_at(json.dumps(truncating))[0] == ""
    with pytest.raises(ValueError, match="cannot be cut"):
        cut_bounds("a b " * 100, "", 10, 50)
    with pytest.raises(ValueError, match="no place to cut"):
        cut_bounds("a b " + "x" * 100 + " c", "space", 10, 50)
    assert cut_bounds("a b " + "x" * 40, "space", 10, 50) == [(0, 3), (3, 44)]


def test_preprocess_long_documents_in_pieces_is_byte_identical(tmp_path, tokenizers):
    texts = [" ".join(tricky_texts(3, 300, seed=s)) for s in range(4)] + ["", "short one"]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    outputs = []
    for piece_chars in (10**9, 50):
        for split in (False, True):
            prefix = tmp_path / f"out{piece_chars}{split}"
            preprocess(PreprocessOptions(
                inputs=[str(src)], output_prefix=str(prefix), tokenizer=tokenizers["gpt2"],
                append_eod=True, split_sentences=split, progress=False, piece_chars=piece_chars))
            level = "sentence" if split else "document"
            outputs.append([open(f"{prefix}_text_{level}{ext}", "rb").read()
                            for ext in (".bin", ".idx")])
    assert outputs[0] == outputs[2] and outputs[1] == outputs[3]
    assert IndexedDataset(tmp_path / "out50False_text_document").num_documents == len(texts)


def test_too_long_for_the_tokenizer_is_one_line_and_skippable(tmp_path, tokenizers, capsys):
    spec = json.loads(open(tokenizers["gpt2"]).read())
    spec["normalizer"] = {"type": "Lowercase"}  # nothing vouches for cutting this one
    lower = tmp_path / "lower.json"
    lower.write_text(json.dumps(spec))
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "fine"}\n' + json.dumps({"text": "word " * 100}) + "\n")
    args = ["preprocess", "--input", str(src), "--output-prefix", str(tmp_path / "out"),
            "--tokenizer", str(lower), "--no-progress", "--workers", "1"]
    options = dict(piece_chars=10, max_piece_chars=100)
    with pytest.raises(Exception, match=r"in.jsonl:2: document too long \('text': 500 "):
        preprocess(PreprocessOptions(inputs=[str(src)], output_prefix=str(tmp_path / "out"),
                                     tokenizer=str(lower), progress=False, **options))
    assert [p for p in os.listdir(tmp_path) if "out" in p] == []
    report = preprocess(PreprocessOptions(
        inputs=[str(src)], output_prefix=str(tmp_path / "out"), tokenizer=str(lower),
        progress=False, skip_bad_lines=True, **options))
    assert report.documents == 1 and report.skipped == {"document too long": 1}
    assert main(args) == 0  # the default limits take it whole
    capsys.readouterr()


CHILD = """
import resource, sys
from trireme.data.preprocess import PreprocessOptions, preprocess
preprocess(PreprocessOptions(inputs=[sys.argv[1]], output_prefix=sys.argv[2],
                             tokenizer=sys.argv[3], workers=1, progress=False))
"""
PARENT = """
import resource, subprocess, sys
subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], check=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mib(*args):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(__file__)))
    out = subprocess.run([sys.executable, "-c", PARENT, CHILD, *map(str, args)], env=env,
                         capture_output=True, text=True, timeout=600, check=True)
    return int(out.stdout.split()[-1]) / 1024


def test_one_huge_document_takes_about_the_memory_of_many_small(tmp_path, tokenizers):
    rng = np.random.default_rng(0)
    words = np.array(["the", "tokenizer", "of", "42", "ünïcode", "pieces", "x=1;", "\n", "  "])
    text = " ".join(rng.choice(words, 3_200_000))[: 20 << 20]  # 20 MiB
    one, many = tmp_path / "one.jsonl", tmp_path / "many.jsonl"
    one.write_text(json.dumps({"text": text}) + "\n")
    step = 100_000
    many.write_text("".join(json.dumps({"text": text[i:i + step]}) + "\n"
                            for i in range(0, len(text), step)))
    peak_one = peak_rss_mib(one, tmp_path / "o1", tokenizers["gpt2"])
    peak_many = peak_rss_mib(many, tmp_path / "o2", tokenizers["gpt2"])
    # before the cutting, one 20 MiB document took about 4 GiB
    assert peak_one < 2 * peak_many, (peak_one, peak_many)
    assert peak_one - peak_many < 6 * 20, (peak_one, peak_many)
    assert IndexedDataset(tmp_path / "o1_text_document").num_tokens > 1_000_000
