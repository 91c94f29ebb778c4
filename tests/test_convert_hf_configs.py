"""`trireme convert` with Hugging Face: what each config feature becomes (trireme/convert/hf.py).

Qwen2's q/k/v-only biases (model.qkv_bias, not biases everywhere), a sliding attention window
(the context capped at it, said in a note), config.json with both rope_parameters and a legacy
rope_scaling (transformers 5 applies rope_scaling), the context the source supports kept through
fine-tuning at a shorter seq_length, the fp32 master weights of a bf16 run exported at fp32,
bos_token_id from the tokenizer, and a trireme checkpoint given as --from hf. Logits against
`transformers` decide, as in test_convert.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from safetensors.torch import load_file
from test_convert import (
    VOCAB,
    _llama_like,
    assert_close,
    hf_logits,
    make_hf,
    trireme_logits,
)
from test_tensor_parallel import TOLERANCE, check_case, llama
from test_train import tiny_cfg, toy_data  # noqa: F401  (a fixture)

from trireme.checkpoint.store import load_checkpoint, load_model_state
from trireme.cli import main
from trireme.config import Config, ModelConfig, config_from_toml, validate
from trireme.config.model import model_differences
from trireme.convert.convert import convert, write_trireme
from trireme.convert.converted import Converted
from trireme.convert.describe import model_summary
from trireme.convert.hf import read_hf
from trireme.data.tokenizer import train_bpe
from trireme.errors import CheckpointError, ConfigError
from trireme.models.gpt import GPT
from trireme.parallel.mesh import ParallelDims, ParallelMesh
from trireme.training.train import train

transformers = pytest.importorskip("transformers")


def ids_of(length: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(3))


def save_random(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`model` with weights away from their trivial init, saved to `folder` (as make_hf does)."""
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.3 if name.endswith("weight") and p.dim() == 1 else 0.0,
                      0.2 if p.dim() == 1 else 0.1)
    model.eval().save_pretrained(folder)
    return model


# --------------------------------------------------------------------------------------------
# 1. Qwen2: q/k/v biases only


def test_qwen2_gets_qkv_biases_only_and_exports_as_qwen2(tmp_path: Path) -> None:
    hf = make_hf("qwen2-qkv-bias", tmp_path / "hf")
    conv, _ = convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    cfg = conv.model
    assert cfg.qkv_bias and not cfg.bias
    names = set(conv.state)
    assert "layers.0.attention.qkv.bias" in names
    assert not [n for n in names if n.endswith("bias") and "qkv" not in n]  # nothing to train
    model = GPT(cfg, seed=None)
    assert {n for n, _ in model.named_parameters() if n.endswith("bias")} == {
        f"layers.{i}.attention.qkv.bias" for i in range(cfg.num_layers)}
    ids = ids_of(24)
    with torch.no_grad():
        want = hf(ids).logits
    assert_close(trireme_logits(tmp_path / "tri", ids), want)

    # fine-tuning moves the q/k/v biases: still Qwen2 on the way out, no o / MLP biases
    ckpt = load_checkpoint(tmp_path / "tri")
    state = {n: t + 0.05 if n.endswith("qkv.bias") else t for n, t in ckpt.model.items()}
    conv.state = state
    write_trireme(conv, tmp_path / "tuned", torch.float32)
    convert("trireme", "hf", tmp_path / "tuned", tmp_path / "back")
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["model_type"] == "qwen2" and "attention_bias" not in exported
    back = load_file(tmp_path / "back" / "model.safetensors")
    assert sorted(n for n in back if n.endswith("bias")) == sorted(
        f"model.layers.{i}.self_attn.{x}_proj.bias" for i in range(2) for x in "qkv")
    assert_close(hf_logits(tmp_path / "back", ids), trireme_logits(tmp_path / "tuned", ids))


def test_inspect_names_qkv_biases_and_the_supported_context() -> None:
    cfg = ModelConfig(qkv_bias=True, seq_length=128, max_position_embeddings=4096)
    line = model_summary(cfg)
    assert "q/k/v biases" in line and "supports 4096 positions" in line
    assert "q/k/v" not in model_summary(ModelConfig(bias=True, qkv_bias=True))  # all biases


def test_qkv_bias_is_part_of_the_model_identity() -> None:
    saved, here = ModelConfig(qkv_bias=True), ModelConfig()
    assert model_differences(saved, here) == [
        "qkv_bias = False here, True in the checkpoint"]


def qkv_bias_worker(rank: int, world: int, out: str) -> None:
    mesh = ParallelMesh.build(ParallelDims(tensor=world), "cpu")
    for sp in (False, True):  # the q/k/v bias is split with its rows, whichever switch made it
        diffs = check_case(llama(qkv_bias=True, qk_norm=False), sp, mesh)
        for what, value in diffs.items():
            assert value < TOLERANCE, f"qkv_bias TP={world} sp={sp}: {what} differs by {value}"


def test_qkv_bias_under_tensor_parallelism(tmp_path: Path) -> None:
    run_ranks(qkv_bias_worker, 2, tmp_path, str(tmp_path / "out.json"))


# --------------------------------------------------------------------------------------------
# 2. Sliding-window attention: the context capped at the window


@pytest.mark.parametrize("kind,kw,where", [
    ("MistralForCausalLM", dict(sliding_window=16), "every layer"),
    ("Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),
     "1 of 2 layers"),
    ("Qwen3ForCausalLM", dict(sliding_window=16, layer_types=["sliding_attention"] * 2,
                              use_sliding_window=True), "every layer"),
])
def test_a_sliding_window_caps_the_context(tmp_path: Path, kind: str, kw: dict,
                                           where: str) -> None:
    hf = save_random(_llama_like(kind, **kw), tmp_path / "hf")
    conv, _ = convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    assert conv.model.seq_length == conv.model.max_position_embeddings == 16
    assert [n for n in conv.notes if "sliding" in n and where in n and "capped at 16" in n]
    within, beyond = ids_of(16), ids_of(40)
    with torch.no_grad():
        want = hf(within).logits
        assert (hf(beyond).logits - converted_logits(conv, beyond)).abs().max() > 1e-3  # slides
    assert_close(trireme_logits(tmp_path / "tri", within), want)
    convert("trireme", "hf", tmp_path / "tri", tmp_path / "back")
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 16  # no window there: exact up to 16


def converted_logits(conv, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a converted model at any length (RoPE is computed for what it is given)."""
    model = GPT(conv.model, seed=None).eval()
    load_model_state(model, conv.state)
    with torch.no_grad():
        return model(ids)


def test_a_window_beyond_the_context_changes_nothing(tmp_path: Path) -> None:
    save_random(_llama_like("MistralForCausalLM", sliding_window=4096), tmp_path / "hf")
    conv = read_hf(tmp_path / "hf")
    assert conv.model.seq_length == 64 and not conv.notes


# --------------------------------------------------------------------------------------------
# 3. GPT-2 with exact GeLU: said


def test_gpt2_exact_gelu_is_noted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hf = save_random(transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        activation_function="gelu")), tmp_path / "hf")
    assert main(["convert", "--from", "hf", "--to", "trireme", "--input", str(tmp_path / "hf"),
                 "--output", str(tmp_path / "tri")]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if "note:" in line]
    assert [n for n in notes if "exact (erf) GeLU" in n and "tanh" in n]
    ids = ids_of(24)
    with torch.no_grad():
        assert_close(trireme_logits(tmp_path / "tri", ids), hf(ids).logits, rel=1e-2)


# --------------------------------------------------------------------------------------------
# 4. rope_parameters and a legacy rope_scaling: transformers 5 applies rope_scaling


def with_legacy_rope_scaling(folder: Path, scaling: dict) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "default"
    (folder / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))


def test_a_legacy_rope_scaling_beside_rope_parameters_is_read(tmp_path: Path) -> None:
    save_random(_llama_like("LlamaForCausalLM", rope_parameters={
        "rope_type": "default", "rope_theta": 50000.0}), tmp_path / "hf")
    with_legacy_rope_scaling(tmp_path / "hf", {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})
    conv, _ = convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    assert conv.model.rope_scaling == "llama3"
    ids = ids_of(40)
    assert_close(trireme_logits(tmp_path / "tri", ids), hf_logits(tmp_path / "hf", ids))

    save_random(_llama_like("LlamaForCausalLM"), tmp_path / "linear")
    with_legacy_rope_scaling(tmp_path / "linear", {"type": "linear", "factor": 2.0})
    with pytest.raises(CheckpointError, match="rope scaling 'linear' is not supported"):
        convert("hf", "trireme", tmp_path / "linear", tmp_path / "out")


# --------------------------------------------------------------------------------------------
# 5. The context the model supports survives fine-tuning at a shorter seq_length


def test_export_keeps_the_sources_context(tmp_path: Path) -> None:
    make_hf("llama-mqa-tied", tmp_path / "hf")  # max_position_embeddings 64
    conv = read_hf(tmp_path / "hf")
    conv.model.seq_length = 32  # what --model.seq_length=32 leaves in a fine-tuned checkpoint
    write_trireme(conv, tmp_path / "tuned", torch.float32)
    saved = config_from_toml(load_checkpoint(tmp_path / "tuned").config_toml).model
    assert (saved.seq_length, saved.max_position_embeddings) == (32, 64)
    convert("trireme", "hf", tmp_path / "tuned", tmp_path / "back")
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 64

    conv.model.seq_length = 128  # trained longer than the source: the longer one
    write_trireme(conv, tmp_path / "longer", torch.float32)
    convert("trireme", "hf", tmp_path / "longer", tmp_path / "back-longer")
    exported = json.loads((tmp_path / "back-longer" / "config.json").read_text())
    assert exported["max_position_embeddings"] == 128


def test_learned_positions_keep_their_table_size(tmp_path: Path) -> None:
    make_hf("gpt2-tied", tmp_path / "hf")
    conv, _ = convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    assert conv.model.max_position_embeddings == 0
    convert("trireme", "hf", tmp_path / "tri", tmp_path / "back")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["n_positions"] == 64
    cfg = Config()
    cfg.model = ModelConfig(position_embedding="learned", vocab_size=VOCAB, seq_length=64,
                            max_position_embeddings=1024)
    with pytest.raises(ConfigError, match="max_position_embeddings = 1024 with learned"):
        validate(cfg)


# --------------------------------------------------------------------------------------------
# 6. A trireme checkpoint given as a Hugging Face folder


def test_a_trireme_checkpoint_as_hf_input_says_so(tmp_path: Path) -> None:
    make_hf("llama-mqa-tied", tmp_path / "hf")
    _, step_dir = convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    for path in (tmp_path / "tri", step_dir):
        with pytest.raises(CheckpointError, match=r"a trireme checkpoint\? use --from trireme"):
            convert("hf", "trireme", path, tmp_path / "out")


# --------------------------------------------------------------------------------------------
# 7. A bf16 run exported at fp32: its fp32 master weights


@pytest.mark.parametrize("fmt", ["gathered", "sharded"])
def test_fp32_export_of_a_bf16_run_writes_the_masters(toy_data, tmp_path: Path,  # noqa: F811
                                                      fmt: str) -> None:
    trainer = train(tiny_cfg(toy_data, tmp_path, "model.precision=bf16", "train.steps=2",
                             "train.eval_interval=0", f"checkpoint.format={fmt}",
                             f"checkpoint.dir={tmp_path / 'ckpt'}"))
    masters = {n: t.detach().clone() for n, t in trainer.optimizer.masters.items()}
    convert("trireme", "hf", tmp_path / "ckpt", tmp_path / "fp32", dtype="fp32")
    got = load_file(tmp_path / "fp32" / "model.safetensors")
    q_rows = 64  # 4 heads of 16
    qkv = masters["layers.0.attention.qkv.weight"]
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], qkv[:q_rows])
    down = masters["layers.1.mlp.fc2.weight"]
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], down)
    assert not torch.equal(down, down.bfloat16().float())  # the masters are not bf16 values
    convert("trireme", "hf", tmp_path / "ckpt", tmp_path / "auto")  # auto: as stored, bf16
    auto = load_file(tmp_path / "auto" / "model.safetensors")
    assert auto["model.layers.1.mlp.down_proj.weight"].dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# bos_token_id from the tokenizer


def test_bos_token_id_comes_from_the_tokenizer(tmp_path: Path) -> None:
    hf = tmp_path / "hf"
    torch.manual_seed(0)
    _llama_like("LlamaForCausalLM", vocab_size=320).save_pretrained(hf)
    train_bpe(["def f(x):\n    return x + 1\n"] * 50, 320, hf / "tokenizer.json")
    vocab = json.loads((hf / "tokenizer.json").read_text())["model"]["vocab"]
    bos, bos_id = max(vocab.items(), key=lambda item: item[1])  # any token but <|endoftext|>
    (hf / "tokenizer_config.json").write_text(json.dumps({"bos_token": {"content": bos}}))
    convert("hf", "trireme", hf, tmp_path / "tri")
    convert("trireme", "hf", tmp_path / "tri", tmp_path / "back")
    config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (bos_id, 0) and bos_id > 0
    # generation_config.json's end ids (Llama 3: end of text and end of turn) travel into
    # config.json's eos_token_id, as HF's own exports have them
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, bos_id]}))
    convert("hf", "trireme", hf, tmp_path / "tri2")
    convert("trireme", "hf", tmp_path / "tri2", tmp_path / "back2")
    config = json.loads((tmp_path / "back2" / "config.json").read_text())
    assert config["eos_token_id"] == [0, bos_id]
    (hf / "generation_config.json").unlink()

    (hf / "tokenizer_config.json").unlink()  # a template that starts with a special token
    data = json.loads((hf / "tokenizer.json").read_text())
    data["post_processor"] = {"type": "TemplateProcessing",
                              "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                         {"Sequence": {"id": "A", "type_id": 0}}],
                              "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                                       {"Sequence": {"id": "B", "type_id": 1}}],
                              "special_tokens": {"<|endoftext|>": {
                                  "id": "<|endoftext|>", "ids": [0], "tokens": ["<|endoftext|>"]}}}
    (hf / "tokenizer.json").write_text(json.dumps(data))
    convert("hf", "hf", hf, tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["bos_token_id"] == 0


@pytest.mark.parametrize("pattern", ["*-*", "**-", "*--*-"])
def test_a_dense_layer_pattern_other_than_attention_and_mlp_is_not_exported(
        tmp_path: Path, pattern: str) -> None:
    """A layer without its MLP ("*-*") was exported as Llama with 1-D zero 'weights' in its
    place, a folder from_pretrained refuses; two MLPs in a layer named tensors, not why."""
    cfg = ModelConfig(num_layers=2, layer_pattern=pattern, hidden_size=64, num_attention_heads=4,
                      vocab_size=VOCAB, seq_length=32, position_embedding="rope",
                      normalization="rmsnorm", activation="swiglu")
    state = {n: t.detach() for n, t in GPT(cfg, seed=0).state_dict().items()}
    write_trireme(Converted(model=cfg, state=state, source="test"), tmp_path / "tri",
                  torch.float32)
    with pytest.raises(CheckpointError, match=rf"model.layer_pattern = '{re.escape(pattern)}' "
                                              r"has layers .*cannot be exported"):
        convert("trireme", "hf", tmp_path / "tri", tmp_path / "out")
    assert not (tmp_path / "out").exists()
