import dataclasses
import subprocess
import sys

import pytest

from trireme.commands.train import TRAIN_EPILOG
from trireme.config import (
    Config,
    config_from_toml,
    load_config,
    preset_names,
    reference_markdown,
    validate,
)
from trireme.cpu_threads import choose_cpu_threads
from trireme.errors import ConfigError
from trireme.training.train import train

REQUIRED_KEYS = """train.steps train.seed train.global_batch_size train.micro_batch_size
train.eval_interval train.log_interval run.dir data.path checkpoint.dir checkpoint.interval
parallel.tensor parallel.pipeline parallel.virtual_pipeline parallel.context parallel.expert
parallel.sequence_parallel parallel.distributed_optimizer model.num_layers model.hidden_size
model.num_attention_heads model.num_query_groups model.ffn_hidden_size model.vocab_size
model.seq_length model.dropout model.precision""".split()


def test_required_keys_exist_and_documented():
    cfg = Config()
    for key in REQUIRED_KEYS:
        section, name = key.split(".")
        fields = {f.name: f for f in dataclasses.fields(getattr(cfg, section))}
        assert name in fields, key
        assert fields[name].metadata.get("help"), f"{key} has no documentation"


def test_all_fields_documented():
    cfg = Config()
    for section in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, section.name)):
            assert f.metadata.get("help"), f"{section.name}.{f.name}"


@pytest.mark.parametrize("name", ["tiny", "gpt2-124m", "llama3-1b", "llama3-8b", "moe-tiny",
                                  "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
def test_presets_load(name):
    assert name in preset_names()
    cfg = load_config(name)
    assert cfg.model.num_layers > 0


def test_llama3_1b_shape():
    m = load_config("llama3-1b").model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.num_query_groups) == (
        16, 2048, 32, 8)
    assert (m.ffn_hidden_size, m.vocab_size, m.seq_length, m.rope_theta) == (
        8192, 128256, 4096, 500000.0)
    assert m.activation == "swiglu" and m.normalization == "rmsnorm" and m.head_size == 64


def test_overrides_are_type_checked():
    cfg = load_config("tiny", ["--train.steps=7", "model.dropout=0.1",
                               "--parallel.sequence_parallel=true", "optimizer.no_decay=norm"])
    assert cfg.train.steps == 7 and isinstance(cfg.train.steps, int)
    assert cfg.model.dropout == 0.1
    assert cfg.parallel.sequence_parallel is True
    assert cfg.optimizer.no_decay == ["norm"]
    with pytest.raises(ConfigError, match="expected an integer"):
        load_config("tiny", ["train.steps=ten"])
    with pytest.raises(ConfigError, match="expected true or false"):
        load_config("tiny", ["parallel.sequence_parallel=maybe"])
    with pytest.raises(ConfigError, match="not one of"):
        load_config("tiny", ["model.precision=fp8x"])


@pytest.mark.parametrize("key, value, needle", [
    ("schedule.decay_style", "cosin", "schedule.decay_style = 'cosin' is not one of"),
    ("optimizer.lr", float("nan"), "optimizer.lr = nan: expected a finite number"),
    ("train.steps", 2.5, "train.steps = 2.5: expected an integer"),
    ("model.precision", "fp9", "model.precision = 'fp9' is not one of"),
    ("train.device", "tpu", "train.device = 'tpu' is not one of"),
    ("train.global_batch_size", None, "train.global_batch_size = None: expected an integer"),
])
def test_values_set_in_code_are_checked_like_overrides(key, value, needle, tmp_path):
    """A notebook sets fields on a loaded config; validate and train check them as
    --section.key=value is checked (they were tracebacks, or silently taken: an unknown
    decay_style trained with some schedule)."""
    cfg = load_config("tiny", {"run.dir": str(tmp_path / "run")})
    section, name = key.split(".")
    setattr(getattr(cfg, section), name, value)
    with pytest.raises(ConfigError, match=needle):
        validate(cfg, need_vocab=False)
    with pytest.raises(ConfigError, match=needle):
        train(cfg)
    assert not (tmp_path / "run").exists()  # stopped before any work


def test_values_set_in_code_are_parsed_like_overrides():
    cfg = load_config("tiny")
    cfg.train.steps, cfg.optimizer.lr, cfg.train.deterministic = "7", 1, "true"
    cfg.checkpoint.resume_step = 300
    validate(cfg, need_vocab=False)
    assert (cfg.train.steps, cfg.optimizer.lr, cfg.train.deterministic) == (7, 1.0, True)
    assert isinstance(cfg.optimizer.lr, float) and cfg.checkpoint.resume_step == "300"
    cfg.model = None
    with pytest.raises(ConfigError, match="config section model = None: expected a ModelConfig"):
        validate(cfg, need_vocab=False)


def test_one_override_string_is_one_override():
    """load_config("tiny", "train.steps=3") walked the string's characters: "override 't'
    needs a value: write --t=VALUE"."""
    assert load_config("tiny", "--train.steps=3").train.steps == 3


def test_unknown_key_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'train.steps'"):
        load_config("tiny", ["train.stepz=3"])
    with pytest.raises(ConfigError, match="did you mean 'model.hidden_size'"):
        load_config("tiny", ["model.hiden_size=3"])
    with pytest.raises(ConfigError, match="did you mean 'optimizer.lr'"):  # the same key
        load_config("tiny", ["train.lr=1e-3"])  # in another section, before close spellings
    with pytest.raises(ConfigError, match="unknown config section"):
        load_config("tiny", ["modle.hidden_size=3"])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config("tinyy")


def test_divisibility_errors():
    with pytest.raises(ConfigError, match="not divisible by model.num_attention_heads"):
        load_config("tiny", ["model.hidden_size=100", "model.num_attention_heads=3"])
    with pytest.raises(ConfigError, match="num_query_groups"):
        load_config("tiny", ["model.num_attention_heads=6", "model.num_query_groups=4"])
    with pytest.raises(ConfigError, match="global_batch_size"):
        load_config("tiny", ["train.global_batch_size=10", "train.micro_batch_size=4"])


@pytest.mark.parametrize("override,needle", [
    ("optimizer.beta1=1.5", "optimizer.beta1 = 1.5 must be in [0, 1)"),  # was torch's ValueError
    ("optimizer.beta2=-1", "optimizer.beta2 = -1.0 must be in [0, 1)"),
    ("optimizer.eps=-1", "optimizer.eps = -1.0 must not be negative"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay = -0.1 must not be negative"),
    ("optimizer.clip_grad=-1", "0 turns clipping off"),  # was silently off
    ("optimizer.initial_loss_scale=0", "must be > 0"),  # a scale of 0 zeroed the gradients
    ("optimizer.loss_scale_window=0", "at least 1"),
    ("optimizer.min_loss_scale=1e9", "exceeds optimizer.initial_loss_scale"),
    ("train.max_minutes=-1", "train.max_minutes = -1.0 must not be negative"),  # stopped at once
    ("model.init_std=-1", "model.init_std = -1.0 must not be negative"),  # torch's RuntimeError
    ("model.norm_eps=-1", "model.norm_eps = -1.0 must not be negative"),  # NaN losses
    ("model.rope_theta=0", "model.rope_theta = 0.0 must be > 0"),  # NaN losses
])
def test_optimizer_and_training_values_out_of_range_are_one_line_errors(override, needle):
    with pytest.raises(ConfigError) as info:
        load_config("tiny", [override])
    assert needle in str(info.value)


def test_toml_round_trip():
    cfg = load_config("gpt2-124m", ["train.sample_prompt=say \"hi\"\\n"])
    again = config_from_toml(cfg.to_toml())
    assert again == cfg


def test_reference_markdown_lists_every_key():
    md = reference_markdown()
    for key in REQUIRED_KEYS:
        assert f"`{key}`" in md


def run_cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "trireme", *args], capture_output=True,
                          text=True, timeout=120, **kw)


@pytest.mark.parametrize("args,needle", [
    (["train", "--train.stepz=1"], "did you mean 'train.steps'"),
    (["train", "--model.hidden_size=abc"], "expected an integer"),
    (["train", "--model.hidden_size=100", "--model.num_attention_heads=3"], "not divisible"),
    (["train", "--config", "nope"], "unknown preset"),
    (["train", "--data.path=/nonexistent/data"], "/nonexistent/data"),
    (["train", "--parallel.context=2", "--model.dropout=0.1"], "not implemented yet"),
])
def test_cli_bad_input_one_line_exit_2(args, needle, tmp_path):
    r = run_cli(*args, f"--run.dir={tmp_path}/run")
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert needle in lines[0] and "Traceback" not in r.stderr


def test_cli_foreign_idx_file(tmp_path):
    (tmp_path / "d.idx").write_bytes(b"NOTANIDX" * 8)
    (tmp_path / "d.bin").write_bytes(b"\0" * 16)
    r = run_cli("train", f"--data.path={tmp_path}/d", "--data.tokenizer=bytes",
                f"--run.dir={tmp_path}/run")
    assert r.returncode == 2
    assert len(r.stderr.strip().splitlines()) == 1 and "d.idx" in r.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_cli_config_prints_resolved_toml():
    r = run_cli("config", "--config", "llama3-1b", "--train.steps=3")
    assert r.returncode == 0
    assert config_from_toml(r.stdout).train.steps == 3


def test_docs_config_reference_is_current():
    """docs/config.md is generated from the field docs; regenerate with `trireme config-doc`."""
    from pathlib import Path

    doc = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    expected = reference_markdown() + "\n"
    assert doc.read_text() == expected, "run: trireme config-doc > docs/config.md"


def test_train_help_names_the_sections_and_real_keys():
    """`trireme train --help` lists each section with its most used keys (issue 24), and every
    key it names exists."""
    r = run_cli("train", "--help")
    assert r.returncode == 0 and "trireme config-doc" in r.stdout and "layer_pattern" in r.stdout
    cfg = Config()
    block = TRAIN_EPILOG.split("examples:")[0].splitlines()[1:]
    names = 0
    for line in block:
        words = line.replace(":", " ").replace(",", " ").split()
        section = None
        for word in words:
            if hasattr(cfg, word) and dataclasses.is_dataclass(getattr(cfg, word)):
                section = getattr(cfg, word)
            elif section is not None and word not in ("shape", "and", "precision"):
                assert hasattr(section, word), (word, line)
                names += 1
    assert names >= 30


def test_cpu_threads_choice():
    """Issue 24 item 10: cores / local processes, unless train.cpu_threads or OMP_NUM_THREADS."""
    assert choose_cpu_threads(8, 1, None, 0) == (8, "8 cores / 1 local process")
    assert choose_cpu_threads(8, 2, None, 0) == (4, "8 cores / 2 local processes")
    assert choose_cpu_threads(2, 4, None, 0)[0] == 1  # never below one thread
    assert choose_cpu_threads(8, 2, "3", 0) == (None, "OMP_NUM_THREADS=3")  # torch obeys it
    assert choose_cpu_threads(8, 2, "3", 5) == (5, "train.cpu_threads")  # the key wins
    assert choose_cpu_threads(8, 0, "", 0)[0] == 8
    with pytest.raises(ConfigError, match="train.cpu_threads"):
        load_config("tiny", ["train.cpu_threads=-1"])


def test_config_file_not_utf8_is_one_line_error(tmp_path):
    """A TOML file that is not UTF-8 (saved as UTF-16, a binary passed by mistake) was a
    UnicodeDecodeError traceback; it is a ConfigError naming the file."""
    path = tmp_path / "exp.toml"
    path.write_bytes(b"\xff\xfe[model]\n")
    with pytest.raises(ConfigError, match=r"exp\.toml: not valid TOML: not UTF-8 text \(byte 0\)"):
        load_config(str(path))


def test_config_file_with_a_byte_order_mark_loads(tmp_path):
    """A TOML file saved with a UTF-8 byte order mark (Windows Notepad) was refused as invalid
    TOML at line 1."""
    path = tmp_path / "exp.toml"
    path.write_bytes("[train]\nsteps = 7\n".encode("utf-8-sig"))
    assert load_config(str(path)).train.steps == 7


def test_empty_config_name_is_named_as_empty():
    """`--config ""` (an unset shell variable) said "'' is a directory" (Path("") is ".")."""
    with pytest.raises(ConfigError, match="--config is empty"):
        load_config("")
