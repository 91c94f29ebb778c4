"""The tokenizer travels with the checkpoint: `trireme generate` works from another directory
and after the original tokenizer file moved (issue 24 item 4)."""

import pytest

from trireme.checkpoint.tokenizer_copy import TOKENIZER_DIR, keep_tokenizer, tokenizer_for
from trireme.config import config_from_toml, load_config
from trireme.data.tokenizer import absolute_spec, load_tokenizer, train_bpe
from trireme.errors import ConfigError, TriremeError
from trireme.serving.loading import generate_from_checkpoint
from trireme.training.train import train

TEXTS = ["def add(a, b):\n    return a + b\n", "class Point:\n    x: int = 0\n"] * 20


def small_run(tokenizer: str, *extra: str):
    return load_config("tiny", [
        "data.mock=true", f"data.tokenizer={tokenizer}", "run.dir=run", "checkpoint.dir=ckpt",
        "model.num_layers=1", "model.hidden_size=32", "model.num_attention_heads=2",
        "model.num_query_groups=1", "model.ffn_hidden_size=64", "model.seq_length=16",
        "train.global_batch_size=2", "train.micro_batch_size=2", "train.steps=2",
        "train.eval_interval=0", "train.sample_tokens=0", "train.device=cpu",
        "logging.progress=false", "logging.tensorboard=false", *extra,
    ])


def test_generate_from_elsewhere_after_the_tokenizer_moved(tmp_path, monkeypatch):
    run_a, other = tmp_path / "a", tmp_path / "b"
    run_a.mkdir()
    other.mkdir()
    train_bpe(TEXTS, 300, run_a / "tok.json")
    monkeypatch.chdir(run_a)
    train(small_run("tok.json"))  # a relative path, as a user types it
    assert (run_a / "ckpt" / TOKENIZER_DIR / "tokenizer.json").is_file()
    saved = config_from_toml((run_a / "ckpt/step_0000002/config.toml").read_text(), "config")
    assert saved.data.tokenizer == str(run_a / "tok.json")  # absolute
    (run_a / "tok.json").rename(tmp_path / "moved.json")
    monkeypatch.chdir(other)
    text = generate_from_checkpoint(str(run_a / "ckpt"), "def ", max_new_tokens=4, greedy=True)
    assert text.startswith("def ")


def test_the_copy_is_made_once_and_replaced_when_the_tokenizer_changes(tmp_path):
    train_bpe(TEXTS, 300, tmp_path / "one.json")
    train_bpe(TEXTS[:2], 280, tmp_path / "two.json")
    root = tmp_path / "ckpt"
    copy = keep_tokenizer(root, str(tmp_path / "one.json"))
    first = (copy / "tokenizer.json").stat().st_mtime_ns
    assert keep_tokenizer(root, str(tmp_path / "one.json")) == copy
    assert (copy / "tokenizer.json").stat().st_mtime_ns == first  # left alone
    keep_tokenizer(root, str(tmp_path / "two.json"))
    two = load_tokenizer(str(tmp_path / "two.json"))
    assert load_tokenizer(str(copy)).vocab_size == two.vocab_size
    assert sorted(p.name for p in root.iterdir()) == [TOKENIZER_DIR]  # no temporary left
    assert keep_tokenizer(tmp_path / "bytes", "bytes") is None


def test_gpt2_files_are_copied_together(tmp_path):
    train_bpe(TEXTS, 300, tmp_path / "src" / "tokenizer.json")
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    load_tokenizer(str(tmp_path / "src" / "tokenizer.json"))._tok.model.save(str(gpt2))
    copy = keep_tokenizer(tmp_path / "ckpt", str(gpt2))
    assert sorted(p.name for p in copy.iterdir()) == ["merges.txt", "vocab.json"]
    assert load_tokenizer(str(copy)).encode("def x") == load_tokenizer(str(gpt2)).encode("def x")


def test_lookup_order_and_the_error_names_the_flag(tmp_path):
    step = tmp_path / "ckpt" / "step_0000001"
    step.mkdir(parents=True)
    gone = str(tmp_path / "gone.json")
    assert tokenizer_for(step, gone, "bytes") == "bytes"  # --tokenizer first
    assert tokenizer_for(step, "null:7") == "null:7"
    with pytest.raises(ConfigError, match="--tokenizer"):
        tokenizer_for(step, gone)
    with pytest.raises(ConfigError, match="--tokenizer"):
        tokenizer_for(step, "")
    train_bpe(TEXTS, 300, tmp_path / "tok.json")
    assert tokenizer_for(step, str(tmp_path / "tok.json")) == str(tmp_path / "tok.json")
    keep_tokenizer(tmp_path / "ckpt", str(tmp_path / "tok.json"))
    assert tokenizer_for(step, gone) == str(tmp_path / "ckpt" / TOKENIZER_DIR)


def test_absolute_spec(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_spec("bytes") == "bytes" and absolute_spec("null:5") == "null:5"
    assert absolute_spec("t.json") == str(tmp_path / "t.json")
    assert absolute_spec("hf:t.json") == f"hf:{tmp_path / 't.json'}"


def test_missing_explicit_tokenizer_names_the_flag(tmp_path):
    with pytest.raises(TriremeError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "nope.json"), name="--tokenizer")
