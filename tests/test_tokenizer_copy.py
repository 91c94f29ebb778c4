"""The tokenizer travels with the checkpoint (trireme/checkpoint/tokenizer_copy.py): a run keeps
a copy under checkpoint.dir/tokenizer, so `trireme generate` works from another directory and
after the original tokenizer file moved; a Hugging Face model fine-tuned with trireme and exported
back keeps its whole tokenizer (tokenizer_config.json and the files beside it), a converted
checkpoint keeps its tokenizer where it is found after a move, an export without one says so, and
a run that fails its start-up checks writes no copy.

The conversion tests go through the command line (`trireme.cli.main`), on tiny random models:
2 layers, hidden 32, 2 steps.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from serving import make_checkpoint

from trireme.checkpoint.tokenizer_copy import TOKENIZER_DIR, keep_tokenizer, tokenizer_for
from trireme.cli import main
from trireme.config import config_from_toml, load_config
from trireme.data.indexed import IndexedDatasetWriter
from trireme.data.tokenizer import absolute_spec, load_tokenizer, train_bpe
from trireme.errors import ConfigError, TriremeError
from trireme.serving.loading import generate_from_checkpoint
from trireme.training.train import train

try:
    import transformers
except ImportError:
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers")

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


# A Hugging Face model's tokenizer through conversion and fine-tuning

CHAT = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
VOCAB = 320
TRAIN = ["--train.steps=2", "--train.global_batch_size=2", "--train.micro_batch_size=2",
         "--train.eval_interval=0", "--train.sample_tokens=0", "--train.device=cpu",
         "--logging.progress=false", "--logging.tensorboard=false"]


def hf_tokenizer(folder: Path) -> None:
    """A byte-level BPE saved as transformers saves one, with its own begin / end tokens (known
    only from tokenizer_config.json), a chat template and generation defaults."""
    train_bpe(TEXTS, 300, folder / "bpe.json")
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "bpe.json"), bos_token="<|begin|>", eos_token="<|end|>")
    fast.chat_template = CHAT
    fast.save_pretrained(folder)
    (folder / "bpe.json").unlink()
    transformers.GenerationConfig(bos_token_id=fast.bos_token_id,
                                  eos_token_id=fast.eos_token_id).save_pretrained(folder)


def hf_model(folder: Path, with_tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    if with_tokenizer:
        hf_tokenizer(folder)
    return folder


def token_data(prefix: Path) -> Path:
    writer = IndexedDatasetWriter(str(prefix), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(20):
        writer.add_document(rng.integers(1, 300, size=80).tolist())
    writer.finalize()
    return prefix


def convert(source: str, target: str, src: Path, out: Path) -> None:
    assert main(["convert", "--from", source, "--to", target, "--input", str(src),
                 "--output", str(out)]) == 0


def fine_tune(converted: Path, data: Path, into: Path | None = None, *extra: str) -> int:
    """Fine-tune the converted checkpoint as docs/checkpoints.md shows: from its weights into a
    checkpoint.dir of its own (`into`), or in place (None)."""
    where = [f"--checkpoint.init_from={converted}", f"--checkpoint.dir={into}"] if into else [
        f"--checkpoint.dir={converted}"]
    return main(["train", "--config", str(converted / "step_0000000" / "config.toml"), *where,
                 f"--data.path={data}", f"--run.dir={data.parent / 'run'}", *TRAIN, *extra])


def check_tokenizer(folder: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert (tok.bos_token, tok.eos_token) == ("<|begin|>", "<|end|>")
    assert tok.chat_template == CHAT
    assert (folder / "generation_config.json").is_file()


@needs_transformers
def test_an_export_after_fine_tuning_keeps_the_tokenizer_metadata(tmp_path: Path) -> None:
    convert("hf", "trireme", hf_model(tmp_path / "hf"), tmp_path / "conv")
    data = token_data(tmp_path / "data")
    assert fine_tune(tmp_path / "conv", data, tmp_path / "ft") == 0
    convert("trireme", "hf", tmp_path / "ft", tmp_path / "out")
    check_tokenizer(tmp_path / "out")
    assert fine_tune(tmp_path / "conv", data) == 0  # in place
    convert("trireme", "hf", tmp_path / "conv", tmp_path / "out_in_place")
    check_tokenizer(tmp_path / "out_in_place")


@needs_transformers
def test_a_runs_copy_carries_the_files_beside_its_tokenizer(tmp_path: Path) -> None:
    hf_tokenizer(tmp_path / "hf")
    copy = keep_tokenizer(tmp_path / "ckpt", str(tmp_path / "hf"))
    beside = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert sorted(p.name for p in copy.iterdir()) == beside
    check_tokenizer(copy)
    # a file under another name: nothing beside it is taken for its own
    (tmp_path / "hf" / "tokenizer.json").rename(tmp_path / "hf" / "mine.json")
    copy = keep_tokenizer(tmp_path / "other", str(tmp_path / "hf" / "mine.json"))
    assert [p.name for p in copy.iterdir()] == ["tokenizer.json"]
    # GPT-2 files beside a tokenizer.json: the copy still loads them, not the tokenizer.json
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    load_tokenizer(str(tmp_path / "other" / TOKENIZER_DIR))._tok.model.save(str(gpt2))
    train_bpe(TEXTS[:2], 280, gpt2 / "tokenizer.json")
    (gpt2 / "tokenizer_config.json").write_text("{}")
    copy = keep_tokenizer(tmp_path / "third", str(gpt2 / "vocab.json"))
    assert sorted(p.name for p in copy.iterdir()) == [
        "merges.txt", "tokenizer_config.json", "vocab.json"]


@needs_transformers
def test_a_moved_converted_checkpoint_keeps_its_tokenizer(tmp_path: Path, capsys) -> None:
    hf = hf_model(tmp_path / "hf")
    convert("hf", "trireme", hf, tmp_path / "tmpconv")
    (tmp_path / "tmpconv").rename(tmp_path / "moved")
    moved = tmp_path / "moved"
    convert("trireme", "hf", moved, tmp_path / "out")
    check_tokenizer(tmp_path / "out")
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(moved), "--prompt", "def ", "--greedy",
                 "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def ")
    data = token_data(tmp_path / "data")
    assert fine_tune(moved, data, tmp_path / "ft") == 0  # the copy found at its new place
    convert("trireme", "hf", tmp_path / "ft", tmp_path / "out_ft")
    check_tokenizer(tmp_path / "out_ft")
    assert fine_tune(moved, data) == 0
    assert str(moved / TOKENIZER_DIR) in (moved / "step_0000002" / "config.toml").read_text()


@needs_transformers
def test_a_sentencepiece_tokenizer_is_the_converted_checkpoints_tokenizer(
        tmp_path: Path, capsys) -> None:
    """A Hugging Face folder whose tokenizer is a SentencePiece tokenizer.model (Llama 2): the
    copy was made but data.tokenizer stayed empty, so generate said 'the checkpoint names no
    tokenizer' and fine-tuning had no tokenizer to check its data against."""
    spm = pytest.importorskip("sentencepiece")
    hf = tmp_path / "hf"
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=64)).save_pretrained(hf)
    (tmp_path / "corpus.txt").write_text("\n".join(t.replace("\n", " ") for t in TEXTS))
    spm.SentencePieceTrainer.train(input=str(tmp_path / "corpus.txt"),
                                   model_prefix=str(hf / "tokenizer"), vocab_size=80,
                                   model_type="bpe", minloglevel=2)
    convert("hf", "trireme", hf, tmp_path / "conv")
    step = tmp_path / "conv" / "step_0000000" / "config.toml"
    assert f'tokenizer = "{tmp_path / "conv" / TOKENIZER_DIR / "tokenizer.model"}"' in (
        step.read_text())
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "conv"), "--prompt", "def ",
                 "--greedy", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def")


@needs_transformers
@pytest.mark.parametrize("spec", ["bytes", "custom"])
def test_a_trireme_conversion_keeps_a_tokenizer_it_has_no_files_to_copy_of(
        tmp_path: Path, capsys, spec: str) -> None:
    """--from trireme --to trireme (e.g. --dtype bf16) of a checkpoint whose data.tokenizer is
    `bytes` (no files) or a file of another name than tokenizer.json wrote data.tokenizer = "",
    so generate said 'the checkpoint names no tokenizer'; the source's spec is kept."""
    ckpt = make_checkpoint(tmp_path / "ckpt")
    if spec == "custom":  # a byte-level BPE of at most 257 ids, saved as my_tok.json
        train_bpe(TEXTS, 257, tmp_path / "tok" / "my_tok.json")
        spec = str(tmp_path / "tok" / "my_tok.json")
        ckpt = make_checkpoint(tmp_path / "ckpt_custom", tokenizer=spec)
    convert("trireme", "trireme", ckpt, tmp_path / "conv")
    assert f'tokenizer = "{spec}"' in (tmp_path / "conv" / "step_0000000" / "config.toml"
                                       ).read_text()
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "conv"), "--prompt", "def ",
                 "--greedy", "--max-new-tokens", "3", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def")


@needs_transformers
def test_an_export_without_a_tokenizer_says_so(tmp_path: Path, capsys) -> None:
    convert("hf", "trireme", hf_model(tmp_path / "hf", with_tokenizer=False), tmp_path / "ckpt")
    capsys.readouterr()
    convert("trireme", "hf", tmp_path / "ckpt", tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no tokenizer to carry along" in err[0]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "llama"


@needs_transformers
def test_a_run_that_fails_its_start_up_checks_writes_no_tokenizer_copy(tmp_path: Path) -> None:
    """A checkpoint of another shape stops the resume: checkpoint.dir is left as it was."""
    hf_tokenizer(tmp_path / "hf")
    data = token_data(tmp_path / "data")
    model = ["--model.num_layers=2", "--model.num_attention_heads=2",
             "--model.num_query_groups=1", f"--model.vocab_size={VOCAB}", "--model.seq_length=16",
             f"--data.path={data}", f"--checkpoint.dir={tmp_path / 'ckpt'}",
             f"--run.dir={tmp_path / 'run'}", *TRAIN]
    assert main(["train", "--config", "tiny", "--data.tokenizer=bytes",
                 "--model.hidden_size=32", *model]) == 0
    before = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert TOKENIZER_DIR not in before  # bytes: nothing to copy
    assert main(["train", "--config", "tiny", f"--data.tokenizer={tmp_path / 'hf'}",
                 "--model.hidden_size=64", *model]) == 2
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == before
