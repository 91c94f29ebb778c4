"""P.tokenizer.json: preprocess records which tokenizer made a dataset, and training refuses a
data.tokenizer that gives other ids (a dataset tokenized for one model, trained with another's
tokenizer, would train on the wrong words without any error)."""

import json
import shutil

import pytest

from tests.test_preprocess import write_jsonl
from trireme.cli import main
from trireme.config import Config
from trireme.data.tokenizer import train_bpe
from trireme.data.tokenizer_mark import MARK_SUFFIX
from trireme.errors import DataError
from trireme.training.build import resolve_data

TEXTS = ["the cat sat on the mat", "a dog ran far away", "ünïcödé and 東京", "x = 1 + 2"]


def preprocess(tmp_path, name: str, tokenizer: str, *flags) -> str:
    src = write_jsonl(tmp_path / f"{name}.jsonl", [{"text": t} for t in TEXTS])
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / name),
                 "--tokenizer", tokenizer, "--append-eod", "--no-progress", *flags]) == 0
    return str(tmp_path / f"{name}_text_document")


def resolve(prefix: str, tokenizer: str):
    cfg = Config()
    cfg.data.path, cfg.data.tokenizer, cfg.model.vocab_size = prefix, tokenizer, 0
    _, sources, tok = resolve_data(cfg)
    return sources, tok


def test_training_with_the_data_tokenizer_passes_and_another_is_refused(tmp_path):
    prefix = preprocess(tmp_path, "a", "bytes")
    mark = json.loads(open(prefix + MARK_SUFFIX).read())
    assert (mark["tokenizer"], mark["vocab_size"], mark["eod"]) == ("bytes", 257, 256)
    sources, tokenizer = resolve(prefix, "bytes")
    assert tokenizer.vocab_size == 257 and sources.eod == 256
    # null:256 has bytes' vocabulary size and end-of-document id, but other ids
    with pytest.raises(DataError, match="tokenized with 'bytes'.*data.tokenizer 'null:256'"):
        resolve(prefix, "null:256")
    bpe = tmp_path / "tok" / "tokenizer.json"
    bpe.parent.mkdir()
    train_bpe(iter(TEXTS * 20), 300, bpe)
    with pytest.raises(DataError, match="vocabulary 257.*other ids"):
        resolve(prefix, str(bpe))


def test_a_moved_copy_of_the_tokenizer_still_matches(tmp_path):
    first = tmp_path / "one" / "tokenizer.json"
    first.parent.mkdir()
    train_bpe(iter(TEXTS * 20), 300, first)
    prefix = preprocess(tmp_path, "a", str(first))
    moved = tmp_path / "two" / "tokenizer.json"
    moved.parent.mkdir()
    shutil.copy(first, moved)
    resolve(prefix, str(moved))
    other = tmp_path / "three" / "tokenizer.json"  # same size, trained on other text
    other.parent.mkdir()
    train_bpe(iter(["completely different words here, 12345"] * 50), 300, other)
    with pytest.raises(DataError, match="other ids"):
        resolve(prefix, str(other))


def test_data_without_a_mark_is_not_checked_and_a_damaged_mark_is_one_line(tmp_path):
    prefix = preprocess(tmp_path, "a", "bytes")
    (tmp_path / ("a_text_document" + MARK_SUFFIX)).unlink()  # e.g. made by Megatron's tools
    resolve(prefix, "null:256")
    (tmp_path / ("a_text_document" + MARK_SUFFIX)).write_text("{not json")
    with pytest.raises(DataError, match="cannot be read .* delete it"):
        resolve(prefix, "bytes")


def test_merge_keeps_one_mark_and_refuses_two_tokenizers(tmp_path, capsys):
    a, b = preprocess(tmp_path, "a", "bytes"), preprocess(tmp_path, "b", "bytes")
    out = str(tmp_path / "m")
    assert main(["data", "merge", "--input", a, b, "--output-prefix", out]) == 0
    assert json.loads(open(out + MARK_SUFFIX).read())["tokenizer"] == "bytes"
    src = write_jsonl(tmp_path / "ids.jsonl", [{"text": "1 2 3"}])
    assert main(["preprocess", "--input", src, "--output-prefix", str(tmp_path / "n"),
                 "--tokenizer", "null:256", "--no-progress"]) == 0
    c = str(tmp_path / "n_text_document")
    capsys.readouterr()
    assert main(["data", "merge", "--input", a, c, "--output-prefix", str(tmp_path / "x")]) == 2
    assert "different tokenizers" in capsys.readouterr().err
    assert not (tmp_path / "x.bin").exists()
    (tmp_path / ("b_text_document" + MARK_SUFFIX)).unlink()  # one input unmarked: no mark,
    assert main(["data", "merge", "--input", a, b, "--output-prefix", out]) == 0
    assert not (tmp_path / ("m" + MARK_SUFFIX)).exists()  # and the earlier one is gone


def test_chat_data_is_marked(tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                            {"role": "assistant", "content": "hello"}]}) + "\n")
    assert main(["preprocess", "--chat", "--input", str(src), "--output-prefix",
                 str(tmp_path / "chat"), "--tokenizer", "bytes"]) == 0
    with pytest.raises(DataError, match="other ids"):
        resolve(str(tmp_path / "chat"), "null:256")


def test_inspect_with_another_tokenizer_is_one_line(tmp_path, capsys):
    """`trireme data inspect P --tokenizer T` decoded with any T: wrong words silently, or a
    decoder's traceback for ids past its vocabulary (SentencePiece's IndexError). A bad
    --document printed nothing for it."""
    prefix = preprocess(tmp_path, "a", "bytes")
    folder = tmp_path / "bpe"
    folder.mkdir()
    train_bpe(TEXTS * 10, 300, str(folder / "tokenizer.json"))
    capsys.readouterr()
    assert main(["data", "inspect", prefix, "--tokenizer", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "gives other ids than --tokenizer" in err and err.count("\n") == 1, err
    (tmp_path / f"a_text_document{MARK_SUFFIX}").unlink()  # unmarked: the ids still tell
    assert main(["data", "inspect", prefix, "--tokenizer", "null:100"]) == 2
    err = capsys.readouterr().err
    assert "outside --tokenizer 'null:100' (vocabulary 101)" in err and err.count("\n") == 1
    for document in ("4", "-1"):
        assert main(["data", "inspect", prefix, "--document", document]) == 2
        assert "documents 0 to 3" in capsys.readouterr().err
    assert main(["data", "inspect", prefix, "--tokenizer", "bytes", "--document", "3"]) == 0
    assert "x = 1 + 2" in capsys.readouterr().out
