"""`trireme convert` / `trireme inspect`: Hugging Face and Megatron-Core checkpoints in and out.

Logits are the test everywhere: a converter that only gets the shapes right is wrong. Hugging Face
models are random-init tiny `transformers` models built here (no download); Megatron checkpoints are
the real ones in ../shared/fixtures/megatron-llama-tiny, written by Megatron-LM itself.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from trireme.checkpoint.safe_pickle import load_dcp_metadata, load_torch_file, namespace_dict
from trireme.checkpoint.store import load_checkpoint, load_model_state
from trireme.cli import main
from trireme.config import config_from_toml
from trireme.convert.convert import convert
from trireme.convert.megatron import model_config_from_args
from trireme.errors import CheckpointError
from trireme.models.gpt import GPT

transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "megatron-llama-tiny"
needs_fixture = pytest.mark.skipif(
    not FIXTURE.is_dir(), reason=f"Megatron fixture not found at {FIXTURE}"
)
VOCAB = 100


def trireme_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    return trireme_logits_of(path, ids)


def trireme_logits_of(path: Path, ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
    """Logits of the trireme checkpoint at `path` (model keyword inputs such as images)."""
    ckpt = load_checkpoint(path)
    cfg = config_from_toml(ckpt.config_toml)
    model = GPT(cfg.model, seed=None)
    load_model_state(model, ckpt.model)
    with torch.no_grad():
        return model.eval()(ids, **inputs)


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-4) -> float:
    """Max abs difference, asserted below `rel` x the largest logit."""
    assert got.shape == want.shape
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= rel * want.abs().max().item(), f"max |diff| {diff}"
    return diff


# --------------------------------------------------------------------------------------------
# Hugging Face, both ways


def _llama_like(cls_name: str, **kw: Any):
    cfg_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config"))
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return getattr(transformers, cls_name)(cfg_cls(**{**base, **kw}))


HF_MODELS = {
    "llama-gqa-untied-llama3-rope": lambda: _llama_like(
        "LlamaForCausalLM", tie_word_embeddings=False, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "llama-mqa-tied": lambda: _llama_like(
        "LlamaForCausalLM", num_key_value_heads=1, tie_word_embeddings=True),
    "llama-attention-and-mlp-bias": lambda: _llama_like(
        "LlamaForCausalLM", attention_bias=True, mlp_bias=True),
    "qwen2-qkv-bias": lambda: _llama_like("Qwen2ForCausalLM", tie_word_embeddings=True),
    "qwen3-qk-norm-head-dim": lambda: _llama_like("Qwen3ForCausalLM", head_dim=32),
    "mistral": lambda: _llama_like("MistralForCausalLM", sliding_window=4096),
    "gpt2-tied": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
        bos_token_id=None, eos_token_id=None)),
    "gpt2-untied": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=None)),
}
EXPORTED_AS = {"mistral": "llama"}  # a Mistral without its window is a Llama


def make_hf(kind: str, folder: Path, **save_kw: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = HF_MODELS[kind]().eval()
    with torch.no_grad():  # norms, biases and embeddings away from their trivial init
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.3 if name.endswith("weight") else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.1)
    model.save_pretrained(folder, **save_kw)
    return model


@pytest.mark.parametrize("kind", list(HF_MODELS))
def test_hf_round_trip(tmp_path: Path, kind: str) -> None:
    hf = make_hf(kind, tmp_path / "hf")
    ids = torch.randint(0, VOCAB, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(ids).logits
    assert want.std() > 0.1  # logits with something to compare

    conv, step_dir = convert("hf", "trireme", tmp_path / "hf", tmp_path / "trireme")
    assert step_dir == tmp_path / "trireme" / "step_0000000"
    assert_close(trireme_logits(tmp_path / "trireme", ids), want)

    convert("trireme", "hf", tmp_path / "trireme", tmp_path / "back")
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    expected_type = EXPORTED_AS.get(kind, hf.config.model_type)
    assert exported["model_type"] == expected_type
    assert_close(hf_logits(tmp_path / "back", ids), want)
    original, back = (load_file(tmp_path / d / "model.safetensors") for d in ("hf", "back"))
    assert sorted(back) == sorted(original)
    assert all(torch.equal(back[n], original[n]) for n in original)  # fp32: bit-identical
    if kind == "mistral":  # its window (4096) is beyond the context (64): nothing to say
        assert not any("sliding" in note for note in conv.notes)


def test_hf_sharded_in_and_out_and_dtype(tmp_path: Path) -> None:
    from trireme.convert.hf import read_hf, write_hf

    hf = make_hf("llama-gqa-untied-llama3-rope", tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (1, 32))
    with torch.no_grad():
        want = hf(ids).logits
    conv = read_hf(tmp_path / "hf")
    write_hf(conv, tmp_path / "out", torch.float32, shard_bytes=50_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert_close(hf_logits(tmp_path / "out", ids), want)

    convert("hf", "trireme", tmp_path / "hf", tmp_path / "bf16", dtype="bf16")
    ckpt = load_checkpoint(tmp_path / "bf16")
    assert {t.dtype for t in ckpt.model.values()} == {torch.bfloat16}
    assert config_from_toml(ckpt.config_toml).model.precision == "bf16"
    assert_close(trireme_logits(tmp_path / "bf16", ids), want, rel=3e-2)


# --------------------------------------------------------------------------------------------
# Megatron: the real checkpoints, and TP / PP splits of them laid out as Megatron does


def megatron_reference() -> tuple[torch.Tensor, torch.Tensor]:
    ref = np.load(FIXTURE / "megatron_reference_logits.npz")
    return torch.from_numpy(ref["tokens"]), torch.from_numpy(ref["logits"])


def check_against_megatron(path: Path) -> float:
    tokens, logits = megatron_reference()
    cfg = config_from_toml(load_checkpoint(path).config_toml).model
    assert (cfg.vocab_size, cfg.padded_vocab_size) == (500, 512)
    # fp32 checkpoint and reference: the README asks for about 1e-4 relative
    return assert_close(trireme_logits(path, tokens), logits[..., : cfg.vocab_size], rel=1e-4)


@needs_fixture
@pytest.mark.parametrize("fmt", ["megatron_torch", "megatron_torch_dist"])
def test_megatron_fixture_reproduces_megatron_logits(tmp_path: Path, fmt: str) -> None:
    conv, step_dir = convert("megatron", "trireme", FIXTURE / fmt, tmp_path / "out")
    assert step_dir.name == "step_0000004" and conv.consumed_samples == 16
    assert conv.notes == []
    diff = check_against_megatron(tmp_path / "out")
    print(f"{fmt}: max |logit diff| vs Megatron = {diff:.3g}")


@needs_fixture
def test_megatron_to_hf_gives_megatron_logits(tmp_path: Path) -> None:
    assert main(["convert", "--from", "megatron", "--to", "hf", "--input",
                 str(FIXTURE / "megatron_torch"), "--output", str(tmp_path / "hf")]) == 0
    tokens, logits = megatron_reference()
    assert_close(hf_logits(tmp_path / "hf", tokens), logits[..., :500])


def split_like_megatron(model: dict[str, Any], layers: int, tp: int, pp: int, vpp: int = 1):
    """{(tp_rank, pp_rank): {"model" or "model{v}": state}}: Megatron's legacy layout.

    Column-parallel weights split on dim 0 (linear_qkv by query groups, which its rows are already
    grouped by; SwiGLU's linear_fc1 as [gate_r; up_r] on rank r), row-parallel ones on dim 1, the
    embedding and output layer by vocabulary rows; norms replicated. The layers form pp x vpp
    contiguous chunks; chunk c sits on pipeline rank c % pp as virtual stage c // pp and numbers
    its layers from 0. The embedding is in the first chunk, the final norm and output layer in the
    last.
    """
    per_chunk = layers // (pp * vpp)
    ranks: dict[tuple[int, int], dict[str, Any]] = {
        (t, p): {("model" if vpp == 1 else f"model{v}"): {} for v in range(vpp)}
        for t in range(tp) for p in range(pp)}
    for name, w in model.items():
        parts = name.split(".")
        if name.startswith("decoder.layers."):
            chunk, local = divmod(int(parts[2]), per_chunk)
            parts[2] = str(local)
        else:
            last = name.startswith(("output_layer", "decoder.final"))
            chunk = pp * vpp - 1 if last else 0
        stage, v = chunk % pp, chunk // pp
        if w is None or not torch.is_tensor(w):
            pieces = [w] * tp
        elif "linear_fc1.weight" in name:
            gate, up = w.chunk(2)
            pieces = [torch.cat([g, u]) for g, u in zip(gate.chunk(tp), up.chunk(tp))]
        elif "linear_qkv.weight" in name or name.endswith(("word_embeddings.weight",
                                                            "output_layer.weight")):
            pieces = list(w.chunk(tp, dim=0))
        elif "linear_proj.weight" in name or "linear_fc2.weight" in name:
            pieces = list(w.chunk(tp, dim=1))
        else:
            pieces = [w] * tp
        key = "model" if vpp == 1 else f"model{v}"
        for t in range(tp):
            ranks[(t, stage)][key][".".join(parts)] = None if w is None else pieces[t].clone()
    return ranks


def write_split_checkpoint(root: Path, tp: int, pp: int, vpp: int = 1, mutate=None) -> Path:
    src = load_torch_file(FIXTURE / "megatron_torch" / "iter_0000004" / "mp_rank_00" /
                          "model_optim_rng.pt")
    plain = (int, float, str, bool, type(None), torch.dtype)
    args = {k: v for k, v in namespace_dict(src["args"]).items() if isinstance(v, plain)}
    args.update(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    if mutate:
        mutate(args)
    for (t, p), models in split_like_megatron(src["model"], 2, tp, pp, vpp).items():
        rank_dir = root / "iter_0000004" / (f"mp_rank_{t:02d}" if pp == 1 else
                                            f"mp_rank_{t:02d}_{p:03d}")
        rank_dir.mkdir(parents=True)
        torch.save({"args": argparse.Namespace(**args), "checkpoint_version": 3.0,
                    "iteration": 4, **models}, rank_dir / "model_optim_rng.pt")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    return root


@needs_fixture
@pytest.mark.parametrize("tp,pp,vpp", [(2, 1, 1), (2, 2, 1), (2, 1, 2)])
def test_megatron_tensor_and_pipeline_split(tmp_path: Path, tp: int, pp: int, vpp: int) -> None:
    root = write_split_checkpoint(tmp_path / "split", tp, pp, vpp)
    rank_dir = "mp_rank_01" if pp == 1 else "mp_rank_01_000"
    shard = load_torch_file(root / "iter_0000004" / rank_dir / "model_optim_rng.pt")
    first = shard["model" if vpp == 1 else "model0"]
    assert first["decoder.layers.0.mlp.linear_fc1.weight"].shape == (160, 64)  # [gate_1; up_1]
    assert first["embedding.word_embeddings.weight"].shape == (256, 64)
    conv, _ = convert("megatron", "trireme", root, tmp_path / "out")
    assert f"TP={tp} PP={pp}" in conv.source and (vpp == 1 or f"VPP={vpp}" in conv.source)
    check_against_megatron(tmp_path / "out")


# --------------------------------------------------------------------------------------------
# Bad input: a clear error naming the file or the keys, nothing half-written


def test_hf_bad_input(tmp_path: Path) -> None:
    make_hf("llama-mqa-tied", tmp_path / "hf", max_shard_size="40KB")
    good = tmp_path / "hf"

    broken = tmp_path / "truncated"
    shutil.copytree(good, broken)
    shard = sorted(broken.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated or corrupted"):
        convert("hf", "trireme", broken, tmp_path / "out")
    assert not (tmp_path / "out").exists()

    shard.unlink()
    with pytest.raises(CheckpointError, match=f"{shard.name} is missing"):
        convert("hf", "trireme", broken, tmp_path / "out")

    wrong = tmp_path / "wrong-shape"
    shutil.copytree(good, wrong)
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] = 80
    (wrong / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.gate_proj\.weight: \(96, 64\) "
                                              r"vs \(80, 64\)"):
        convert("hf", "trireme", wrong, tmp_path / "out")

    (wrong / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        convert("hf", "trireme", wrong, tmp_path / "out")

    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    with pytest.raises(CheckpointError, match="already exists"):
        convert("hf", "trireme", good, tmp_path / "taken")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


@needs_fixture
def test_megatron_bad_input(tmp_path: Path) -> None:
    root = write_split_checkpoint(tmp_path / "split", 2, 1)
    rank1 = root / "iter_0000004" / "mp_rank_01" / "model_optim_rng.pt"
    data = rank1.read_bytes()
    rank1.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"mp_rank_01/model_optim_rng.pt is (not a torch "
                                              r"zip|truncated)"):
        convert("megatron", "trireme", root, tmp_path / "out")
    rank1.unlink()
    with pytest.raises(CheckpointError, match="mp_rank_01/model_optim_rng.pt is missing"):
        convert("megatron", "trireme", root, tmp_path / "out")

    wrong = write_split_checkpoint(tmp_path / "wrong", 1, 1,
                                   mutate=lambda a: a.update(ffn_hidden_size=128))
    with pytest.raises(CheckpointError, match=r"layers\.0\.mlp\.fc1\.weight: \(320, 64\) vs "
                                              r"\(256, 64\)"):
        convert("megatron", "trireme", wrong, tmp_path / "out")

    dist = tmp_path / "dist"
    shutil.copytree(FIXTURE / "megatron_torch_dist", dist)
    data_file = dist / "iter_0000004" / "__0_0.distcp"
    data_file.chmod(0o644)
    data_file.write_bytes(data_file.read_bytes()[:100_000])
    with pytest.raises(CheckpointError, match=r"__0_0.distcp is truncated"):
        convert("megatron", "trireme", dist, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@needs_fixture
def test_convert_options_no_conversion_can_use_are_one_line_errors(tmp_path: Path, capsys
                                                                     ) -> None:
    """--step -5 was a ValueError traceback after reading the input; --vocab-size 9999 on a
    512-row Megatron embedding was dropped for the padded 512 with a note that the checkpoint
    records no vocabulary (it records 500); --vocab-size with --from hf was ignored."""
    meg = FIXTURE / "megatron_torch"
    for argv in (["--from", "megatron", "--step", "-5"],
                 ["--from", "megatron", "--vocab-size", "-3"],
                 ["--from", "megatron", "--vocab-size", "9999"],
                 ["--from", "trireme", "--vocab-size", "50"]):
        assert main(["convert", *argv, "--to", "trireme", "--input", str(meg),
                     "--output", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err, err
        assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match=r"--vocab-size 9999 is larger than the "
                                              r"checkpoint's embedding \(512 rows"):
        convert("megatron", "trireme", meg, tmp_path / "out", vocab_size=9999)
    conv, _ = convert("megatron", "trireme", meg, tmp_path / "out", vocab_size=500)
    assert conv.model.vocab_size == 500


class RunsCode:
    """Unpickling this runs a shell command: what a malicious checkpoint would do."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_pickles_are_refused_unexecuted(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    iter_dir = tmp_path / "meg" / "iter_0000001" / "mp_rank_00"
    iter_dir.mkdir(parents=True)
    torch.save({"args": RunsCode(marker), "model": {}}, iter_dir / "model_optim_rng.pt")
    (tmp_path / "meg" / "latest_checkpointed_iteration.txt").write_text("1")
    refused = r"refers to (posix|os)\.system.*nothing was executed"
    with pytest.raises(CheckpointError, match=refused):
        convert("megatron", "trireme", tmp_path / "meg", tmp_path / "out")
    assert main(["convert", "--from", "megatron", "--to", "trireme", "--input",
                 str(tmp_path / "meg"), "--output", str(tmp_path / "out")]) == 2

    metadata = tmp_path / ".metadata"
    buf = io.BytesIO()
    pickle.dump({"state_dict_metadata": RunsCode(marker)}, buf)
    metadata.write_bytes(buf.getvalue())
    with pytest.raises(CheckpointError, match=r"global (posix|os)\.system is not allowed"):
        load_dcp_metadata(metadata)
    assert not marker.exists()


# --------------------------------------------------------------------------------------------
# inspect, and training on from a converted checkpoint


@needs_fixture
def test_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    convert("megatron", "trireme", FIXTURE / "megatron_torch", tmp_path / "tri")
    convert("trireme", "hf", tmp_path / "tri", tmp_path / "hf")
    for path, expected in [
        (tmp_path / "tri", ["trireme checkpoint", "step               4", "151.87K",
                            "vocab 500 (padded 512)", "empty (a fresh optimizer"]),
        (tmp_path / "hf", ["hugging face llama", "LlamaForCausalLM", "150.34K"]),
        (FIXTURE / "megatron_torch_dist", ["megatron checkpoint", "torch_dist",
                                           "iteration          4"]),
        (FIXTURE / "megatron_torch", ["legacy, TP=1 PP=1", "4 heads / 2 query groups"]),
    ]:
        assert main(["inspect", str(path)]) == 0
        out = capsys.readouterr().out
        for text in expected:
            assert text in out, (text, out)
    assert main(["inspect", str(tmp_path / "nothing")]) == 2


def test_inspect_names_a_missing_shard(tmp_path: Path, capsys) -> None:
    """A shard the index lists but the folder lacks: inspect said 'is truncated or corrupted
    (No such file or directory ...)', convert 'is missing'."""
    make_hf("llama-mqa-tied", tmp_path / "hf", max_shard_size="20KB")
    shards = sorted((tmp_path / "hf").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[1].unlink()
    assert main(["inspect", str(tmp_path / "hf")]) == 2
    assert f"{shards[1]} is missing (listed in" in capsys.readouterr().err


def test_a_single_file_wins_over_a_stale_index_as_in_transformers(tmp_path: Path) -> None:
    """save_pretrained of an unsharded model into a sharded folder removes the old shards but
    leaves model.safetensors.index.json: transformers loads model.safetensors, trireme read the
    index and refused the folder (its shards missing)."""
    hf = make_hf("llama-mqa-tied", tmp_path / "hf", max_shard_size="20KB")
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(1.5)
    hf.save_pretrained(tmp_path / "hf")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(1))
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    assert_close(trireme_logits(tmp_path / "tri", ids), hf_logits(tmp_path / "hf", ids))


def test_a_quantized_model_is_named_as_one(tmp_path: Path, capsys) -> None:
    """GPTQ / AWQ / fp8 folders (packed integers, scales beside the weights) were refused as
    'does not match its config.json: missing ... unexpected ...'."""
    make_hf("llama-mqa-tied", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"quantized weights \(quantization_config: fp8\) "
                                              "are not supported"):
        convert("hf", "trireme", tmp_path / "hf", tmp_path / "out")
    assert main(["inspect", str(tmp_path / "hf")]) == 0
    assert "not convertible: config.json: quantized weights" in capsys.readouterr().out


def test_the_quantization_check_reads_only_a_text_config_that_is_an_object(tmp_path: Path
                                                                           ) -> None:
    """A Llama config.json with a stray non-object text_config converted (it is not read), until
    the check for a quantized LLaVA language model made it an AttributeError traceback."""
    make_hf("llama-mqa-tied", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "text_config": "x"}))
    convert("hf", "trireme", tmp_path / "hf", tmp_path / "out")
    assert (tmp_path / "out").is_dir()


def test_fp16_output_of_values_past_its_range_is_refused(tmp_path: Path) -> None:
    """--dtype fp16 of a weight past 65504 wrote Inf: the output was damaged (inspect --verify)
    and said nothing."""
    make_hf("llama-mqa-tied", tmp_path / "hf")
    tensors = load_file(tmp_path / "hf" / "model.safetensors")
    tensors["model.layers.0.input_layernorm.weight"][0] = 1e5
    save_file(tensors, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    for target in ("trireme", "hf"):
        with pytest.raises(CheckpointError, match=r"(input_layernorm|attention_norm).weight "
                           r"holds values beyond float16's range \(largest magnitude 1e\+05"):
            convert("hf", target, tmp_path / "hf", tmp_path / f"to_{target}", dtype="fp16")
        assert not (tmp_path / f"to_{target}").exists()
        convert("hf", target, tmp_path / "hf", tmp_path / f"to_{target}", dtype="bf16")


@pytest.mark.parametrize("change, says", [
    ({"hidden_size": "64"}, "model.hidden_size = '64', not an integer"),
    ({"num_attention_heads": 4.5}, "model.num_attention_heads = 4.5, not an integer"),
    ({"max_position_embeddings": None}, "model.seq_length = None, not an integer"),
    ({"rms_norm_eps": None}, "holds a value of the wrong type"),
    ({"rope_scaling": "linear"}, "holds a value of the wrong type")])
def test_a_config_json_value_of_the_wrong_type_is_one_line(tmp_path: Path, capsys,
                                                           change: dict, says: str) -> None:
    """A null or a string where config.json should hold a number was a TypeError or
    AttributeError traceback from convert and inspect."""
    make_hf("llama-mqa-tied", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    argv = ["--from", "hf", "--to", "trireme", "--input", str(tmp_path / "hf"), "--output",
            str(tmp_path / "out")]
    assert main(["convert", *argv]) == 2
    assert says in capsys.readouterr().err
    assert main(["inspect", str(tmp_path / "hf")]) == 0
    assert "not convertible: config.json" in capsys.readouterr().out


@needs_fixture
def test_from_hf_names_a_file_or_a_megatron_checkpoint(tmp_path: Path) -> None:
    """--from hf --input hf/config.json said 'hf/config.json/config.json is missing'; a
    Megatron checkpoint there, only that config.json is missing."""
    make_hf("llama-mqa-tied", tmp_path / "hf")
    with pytest.raises(CheckpointError, match=r"config.json is a file; give the Hugging Face "
                                              "folder"):
        convert("hf", "trireme", tmp_path / "hf" / "config.json", tmp_path / "out")
    with pytest.raises(CheckpointError, match="is a Megatron-LM checkpoint: use --from megatron"):
        convert("hf", "trireme", FIXTURE / "megatron_torch", tmp_path / "out")


@needs_fixture
def test_training_continues_from_a_converted_checkpoint(tmp_path: Path) -> None:
    """checkpoint.dir = a converted checkpoint: the run resumes from its weights with a fresh
    optimizer. With lr = 0 the weights it saves must be exactly the converted ones."""
    from trireme.config import load_config
    from trireme.data.indexed import IndexedDatasetWriter
    from trireme.training.train import train

    convert("megatron", "trireme", FIXTURE / "megatron_torch", tmp_path / "ckpt", step=0)
    writer = IndexedDatasetWriter(str(tmp_path / "toy"), np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        writer.add_document(rng.integers(0, 256, size=100).tolist())
    writer.finalize()
    cfg = load_config(str(tmp_path / "ckpt" / "step_0000000" / "config.toml"), [
        f"data.path={tmp_path / 'toy'}", "data.tokenizer=bytes",
        f"checkpoint.dir={tmp_path / 'ckpt'}",
        f"run.dir={tmp_path / 'run'}", "train.steps=2", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.eval_interval=0", "train.sample_tokens=0",
        "optimizer.lr=0", "optimizer.min_lr=0", "logging.progress=false",
        "logging.tensorboard=false", "train.device=cpu",
    ])
    train(cfg)
    before = load_checkpoint(tmp_path / "ckpt" / "step_0000000").model
    after = load_checkpoint(tmp_path / "ckpt")
    assert after.step == 2 and after.optimizer["exp_avg"]  # trained on, with real Adam state
    for name, t in before.items():
        assert torch.equal(after.model[name], t), name


def test_tokenizer_travels_and_generate_works(tmp_path: Path) -> None:
    """An HF folder's tokenizer files go along, and `trireme generate` runs on the result."""
    from trireme.data.tokenizer import train_bpe
    from trireme.serving.loading import generate_from_checkpoint

    hf = tmp_path / "hf"
    torch.manual_seed(0)
    _llama_like("LlamaForCausalLM", vocab_size=320).save_pretrained(hf)
    train_bpe(["def f(x):\n    return x + 1\n"] * 50, 320, hf / "tokenizer.json")
    (hf / "generation_config.json").write_text("{}")
    convert("hf", "trireme", hf, tmp_path / "tri")
    copied = (tmp_path / "tri" / "tokenizer" / "tokenizer.json").read_bytes()
    assert copied == (hf / "tokenizer.json").read_bytes()
    cfg = config_from_toml(load_checkpoint(tmp_path / "tri").config_toml)
    assert cfg.data.tokenizer == str((tmp_path / "tri" / "tokenizer" / "tokenizer.json").resolve())
    text = generate_from_checkpoint(str(tmp_path / "tri"), "def ", max_new_tokens=4, greedy=True,
                                    device="cpu")
    assert text.startswith("def ")
    convert("trireme", "hf", tmp_path / "tri", tmp_path / "back")
    assert {p.name for p in (tmp_path / "back").iterdir()} == {
        "config.json", "model.safetensors", "tokenizer.json", "generation_config.json"}
    # HF's generate stops at the tokenizer's end-of-text; every file has the same, usual mode
    hf_config = json.loads((tmp_path / "back" / "config.json").read_text())
    assert hf_config["eos_token_id"] == 0  # train_bpe puts <|endoftext|> at id 0
    modes = {(p.stat().st_mode & 0o777) for p in (tmp_path / "back").iterdir()}
    assert len(modes) == 1 and modes.pop() & 0o044 == 0o044  # group and others can read


def test_a_tied_config_with_its_own_lm_head_keeps_the_head(tmp_path: Path) -> None:
    """config.json says tied, the files hold an lm_head.weight of other values: transformers
    loads it untied, and so does the conversion (it used to drop the head silently)."""
    make_hf("llama-gqa-untied-llama3-rope", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config,
                                                              "tie_word_embeddings": True}))
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    want = hf_logits(tmp_path / "hf", ids)  # as transformers reads the folder
    conv, _ = convert("hf", "trireme", tmp_path / "hf", tmp_path / "tri")
    assert not conv.model.tie_embeddings and any("lm_head" in n for n in conv.notes)
    assert_close(trireme_logits(tmp_path / "tri", ids), want)


def test_convert_refuses_nan_weights_and_unusable_outputs_before_reading(tmp_path: Path,
                                                                         monkeypatch) -> None:
    hf = make_hf("llama-mqa-tied", tmp_path / "hf")
    with torch.no_grad():
        hf.model.layers[1].mlp.up_proj.weight[3, 5] = float("nan")
    hf.save_pretrained(tmp_path / "nan")
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.fc1\.weight holds NaN or Inf"):
        convert("hf", "trireme", tmp_path / "nan", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (tmp_path / "afile").write_text("x")
    read = []
    monkeypatch.setattr("trireme.convert.convert.read_any", lambda *a, **k: read.append(a))
    for output, needle in [(tmp_path / "afile" / "sub", "is a file"),
                           (tmp_path / "hf", "already exists")]:
        with pytest.raises(CheckpointError, match=needle):
            convert("hf", "trireme", tmp_path / "hf", output)
    assert read == []  # refused before the input was read


def test_an_index_naming_files_outside_its_folder_is_refused(tmp_path: Path) -> None:
    make_hf("llama-mqa-tied", tmp_path / "hf")
    sneaky = tmp_path / "sneaky"
    sneaky.mkdir()
    (sneaky / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
    names = list(load_file(tmp_path / "hf" / "model.safetensors"))
    (sneaky / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {n: "../hf/model.safetensors" for n in names}}))
    with pytest.raises(CheckpointError, match="outside its folder"):
        convert("hf", "trireme", sneaky, tmp_path / "out")


def test_reading_a_hugging_face_folder_as_a_checkpoint_says_convert_it(tmp_path: Path) -> None:
    make_hf("llama-mqa-tied", tmp_path / "hf")
    with pytest.raises(CheckpointError, match="looks like a Hugging Face model.*trireme convert"):
        load_checkpoint(tmp_path / "hf")


@needs_fixture
@pytest.mark.parametrize("where", ["megatron_torch", "megatron_torch/iter_0000004",
                                   "megatron_torch_dist", "megatron_torch_dist/iter_0000004"])
def test_reading_a_megatron_checkpoint_as_a_checkpoint_says_convert_it(where: str) -> None:
    """checkpoint.init_from / generate --checkpoint given a Megatron checkpoint said only 'no
    complete checkpoint (expected step_*/meta.json)'."""
    with pytest.raises(CheckpointError, match="looks like a Megatron-LM checkpoint.*trireme "
                                              "convert --from megatron"):
        load_checkpoint(FIXTURE / where, name="checkpoint.init_from")


@needs_fixture
def test_inspect_verify_names_a_foreign_checkpoint(tmp_path: Path, capsys) -> None:
    """inspect --verify on a Hugging Face folder or a Megatron checkpoint said 'no checkpoint in
    PATH' (plain inspect describes both)."""
    make_hf("llama-mqa-tied", tmp_path / "hf")
    for path, kind in ((tmp_path / "hf", "a Hugging Face model"),
                       (FIXTURE / "megatron_torch", "a Megatron-LM checkpoint"),
                       (FIXTURE / "megatron_torch_dist" / "iter_0000004",
                        "a Megatron-LM checkpoint")):
        assert main(["inspect", "--verify", str(path)]) == 2
        assert f"{path} is {kind}: --verify checks trireme checkpoints" in capsys.readouterr().err


@pytest.mark.parametrize("setting, what", [
    ({"apply_residual_connection_post_layernorm": True}, "post-norm residual connections"),
    ({"qk_l2_norm": True}, "L2 QK-norm"), ({"no_rope_freq": 4}, "layers without RoPE"),
    ({"window_size": (128, 0)}, "sliding-window attention"),
    ({"softmax_type": "off-by-one"}, "attention sinks"), ({"use_mup": True}, "muP"),
    ({"glu_linear_offset": 1.0}, "a GLU linear offset"),
    ({"activation_func_clamp_value": 7.0}, "a clamped activation")])
def test_megatron_settings_without_tensors_are_refused(setting: dict, what: str) -> None:
    """Megatron settings that change what the weights compute without a tensor of their own
    converted silently into a model with other logits."""
    args = {**dict(num_layers=2, hidden_size=64, num_attention_heads=4, swiglu=True,
                   position_embedding_type="rope", seq_length=128, normalization="RMSNorm",
                   softmax_type="vanilla", glu_linear_offset=0.0), **setting}
    with pytest.raises(CheckpointError, match=f"the Megatron model uses {what}"):
        model_config_from_args(args, 128, 100, 1)
    model_config_from_args({**args, **dict.fromkeys(setting)}, 128, 100, 1)  # unset: converts


def test_megatron_rope_model_keeps_the_context_it_supports() -> None:
    args = dict(num_layers=2, hidden_size=64, num_attention_heads=4, swiglu=True,
                position_embedding_type="rope", seq_length=128, max_position_embeddings=4096,
                normalization="RMSNorm")
    cfg, _ = model_config_from_args(args, 128, 100, 1)
    assert (cfg.seq_length, cfg.max_position_embeddings) == (128, 4096)  # exported as 4096
    args.update(position_embedding_type="learned_absolute")  # a table of exactly 4096 rows
    cfg, _ = model_config_from_args(args, 128, 100, 1)
    assert (cfg.seq_length, cfg.max_position_embeddings) == (4096, 0)
