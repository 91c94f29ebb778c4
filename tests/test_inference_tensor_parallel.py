"""Tensor-parallel inference (trireme.serving.tensor_parallel) against one process.

`trireme generate` on 2 gloo processes (as under torchrun) must write what one process writes:
the same completions for a file of prompts through the serving engine (greedy, seeded and
unseeded sampling, a stop string) and the same text for one prompt (`--prompt`, the engine too),
while each rank's KV cache holds only its own key / value heads; and the logits the engine
samples from, for a prefill and three decode steps, must be the one-process model's (within
fp32 rounding: the row-parallel sums add in another order).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
from distributed import run_ranks

import trireme.serving.engine as engine_module
from trireme.checkpoint import format as fmt
from trireme.checkpoint import sharded
from trireme.checkpoint.model_state import model_from_state
from trireme.checkpoint.store import load_checkpoint, save_checkpoint
from trireme.commands.generate import generate_main
from trireme.config import Config, ModelConfig, load_config
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.loading import generate_from_checkpoint, load_for_inference
from trireme.serving.sampling import SamplingParams
from trireme.training.train import train

LINES = [
    {"prompt": "def main(", "max_tokens": 12, "greedy": True},
    {"prompt": "import os\n", "max_tokens": 9, "temperature": 0.9, "top_k": 20, "seed": 5},
    {"prompt": "x", "max_tokens": 14, "temperature": 1.1},  # the engine's shared generator
    {"prompt": "class A:\n    ", "max_tokens": 10, "greedy": True, "stop": ["e"]},
    {"prompt": "ab" * 20, "max_tokens": 6, "top_p": 0.8, "seed": 11},
]

MODELS = {  # name -> model settings; each at TP = 2
    "gqa": dict(num_attention_heads=4, num_query_groups=2),
    "mqa-learned": dict(num_attention_heads=4, num_query_groups=1, position_embedding="learned",
                        normalization="layernorm", activation="gelu", bias=True),
    "hybrid": dict(num_layers=2, layer_pattern="M-*-", num_attention_heads=4,
                   num_query_groups=2, activation="swiglu", mamba_state_dim=8,
                   mamba_head_dim=8, mamba_num_groups=2, mamba_chunk_size=8),
}


def checkpoint(tmp_path, model: dict) -> str:
    cfg = Config()
    settings = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, vocab_size=257,
                    seq_length=64, make_vocab_size_divisible_by=8)
    cfg.model = ModelConfig(**{**settings, **model})
    cfg.data.tokenizer = "bytes"
    state = dict(GPT(cfg.model, seed=3).state_dict())
    save_checkpoint(tmp_path / "ckpt", 0, model=state, optimizer={}, trainer={"step": 0},
                    config_toml=cfg.to_toml())
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in LINES))
    return str(tmp_path / "ckpt")


def run_generate(ckpt: str, tmp_path, output: str) -> str:
    """Both ways of `trireme generate`: the file's completions to `output`, and one prompt's
    text (returned)."""
    args = ["--checkpoint", ckpt, "--device", "cpu", "--max-running", "3",
            "--max-batch-tokens", "24", "--seed", "7"]  # the shared generator's seed
    with contextlib.redirect_stdout(io.StringIO()):
        assert generate_main([*args, "--input", str(tmp_path / "prompts.jsonl"),
                              "--output", str(tmp_path / output)]) == 0
    return generate_from_checkpoint(ckpt, "def f(x):", max_new_tokens=10, device="cpu",
                                    temperature=0.8, top_k=30, seed=2)


@torch.no_grad()
def engine_logits(model: GPT) -> torch.Tensor:
    """[8, vocab]: the logits the engine samples two prompts' tokens from (their last positions,
    then three greedy decode steps), through the paged KV cache."""
    rows, real = [], engine_module.sample_rows

    def recording(logits, *args, **kwargs):
        rows.extend(logits.clone())
        return real(logits, *args, **kwargs)

    engine_module.sample_rows = recording
    try:
        engine = Engine(model, EngineSettings(block_size=4, max_running=2))
        engine.generate([[5, 9, 200, 31, 7], [1, 2, 3, 4, 5]],
                        [SamplingParams(max_tokens=4, greedy=True)] * 2)
    finally:
        engine_module.sample_rows = real
    return torch.stack(rows)


def _ranks(rank: int, world_size: int, ckpt: str, tmp_path) -> None:
    text = run_generate(ckpt, tmp_path, "tp.jsonl")
    loaded = load_for_inference(ckpt, device="cpu")
    attention = next(m for m in loaded.model.modules() if hasattr(m, "num_kv_heads"))
    full_kv = loaded.cfg.model.kv_heads
    assert attention.num_kv_heads == max(full_kv // world_size, 1)  # this rank's heads
    assert attention.num_heads == loaded.cfg.model.num_attention_heads // world_size
    if rank == 0:
        (tmp_path / "tp.txt").write_text(text)
    reference = model_from_state(loaded.cfg.model, load_checkpoint(ckpt).model, "cpu")
    got, want = engine_logits(loaded.model), engine_logits(reference.eval())
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_generate_under_tensor_parallelism_writes_what_one_process_writes(tmp_path, name):
    ckpt = checkpoint(tmp_path, MODELS[name])
    text = run_generate(ckpt, tmp_path, "one.jsonl")
    run_ranks(_ranks, 2, tmp_path, ckpt, tmp_path)
    one = (tmp_path / "one.jsonl").read_text().splitlines()
    tp = (tmp_path / "tp.jsonl").read_text().splitlines()
    assert len(one) == len(LINES) and tp == one
    assert sum(json.loads(line)["completion_tokens"] for line in one) > 20
    assert (tmp_path / "tp.txt").read_text() == text and len(text) > len("def f(x):")


def _slices_only(rank: int, world_size: int, ckpt: str) -> None:
    """Each rank reads only its slices: reading a whole model is made to fail while the ranks
    load; the shards then equal those cut from the whole model, tensor for tensor."""
    whole = (sharded.load_full_tensors, fmt.read_model)
    sharded.load_full_tensors = fmt.read_model = _no_whole_reads
    try:
        loaded = load_for_inference(ckpt, tokenizer="bytes", device="cpu")
    finally:
        sharded.load_full_tensors, fmt.read_model = whole
    cut = model_from_state(loaded.cfg.model, load_checkpoint(ckpt).model, "cpu", torch.float32,
                           loaded.model.ctx)
    got, want = loaded.model.state_dict(), cut.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    vocab = loaded.model.embedding.weight
    assert vocab.shape[0] * world_size > loaded.cfg.model.padded_vocab_size  # TP padding rows
    assert loaded.model.tp.size == world_size


def _no_whole_reads(*args, **kwargs):
    raise AssertionError("a tensor-parallel rank read the whole model")


@pytest.mark.slow
@pytest.mark.parametrize("fmt_name", ["gathered", "sharded"])
def test_tensor_parallel_ranks_read_only_their_slices(tmp_path, fmt_name):
    if fmt_name == "gathered":
        ckpt = checkpoint(tmp_path, MODELS["gqa"])
    else:
        ckpt = str(tmp_path / "ckpt")
        train(load_config("tiny", [
            "data.mock=true", "model.vocab_size=257", "model.make_vocab_size_divisible_by=8",
            "model.num_layers=2", "model.hidden_size=32", "model.num_attention_heads=4",
            "model.num_query_groups=2", "model.ffn_hidden_size=64", "model.seq_length=16",
            "train.steps=2", "train.global_batch_size=2", "train.micro_batch_size=2",
            "train.eval_interval=0", "train.sample_tokens=0", "logging.progress=false",
            "logging.tensorboard=false", f"run.dir={tmp_path / 'run'}",
            f"checkpoint.dir={ckpt}", "checkpoint.format=sharded"]))
    run_ranks(_slices_only, 2, tmp_path, ckpt)


def test_tensor_parallel_engines_refuse_what_they_cannot_run():
    plain = EngineSettings().for_tensor_parallel()
    assert (plain.cuda_graphs, plain.overlap, plain.compile_decode) == (False, False, False)
    assert plain.decode_gemm == "cublas"
    for asked in ("cuda_graphs", "overlap", "compile_decode", "compile_prefill"):
        with pytest.raises(ConfigError, match=asked):
            EngineSettings(**{asked: True}).for_tensor_parallel()


def test_one_process_keeps_every_head(tmp_path):
    ckpt = checkpoint(tmp_path, MODELS["gqa"])
    loaded = load_for_inference(ckpt, device="cpu")
    assert loaded.is_main and loaded.model.tp is None
    assert loaded.model.layers["0"].attention.num_kv_heads == 2
    assert torch.isfinite(loaded.model.embedding.weight).all()


def test_unseeded_sampling_differs_from_start_to_start(tmp_path):
    """Without --seed the engine's shared generator starts from a fresh seed each run (as one
    `trireme generate --prompt` run samples differently from the next); --seed repeats."""
    ckpt = checkpoint(tmp_path, MODELS["gqa"])
    (tmp_path / "one.jsonl").write_text(json.dumps(LINES[2]) + "\n")  # no seed of its own

    def completion(*extra: str) -> str:
        out = tmp_path / "out.jsonl"
        with contextlib.redirect_stdout(io.StringIO()):
            assert generate_main(["--checkpoint", ckpt, "--device", "cpu", "--input",
                                  str(tmp_path / "one.jsonl"), "--output", str(out),
                                  *extra]) == 0
        return json.loads(out.read_text())["text"]

    assert completion("--seed", "3") == completion("--seed", "3")
    assert len({completion(), completion(), completion()}) == 3


@pytest.mark.slow
def test_torchrun_generate_writes_and_prints_once(tmp_path):
    """The command as a user runs it: torchrun starts the group, rank 0 alone writes the file and
    prints the one-prompt text, and both equal one process's."""
    ckpt = checkpoint(tmp_path, MODELS["gqa"])
    text = run_generate(ckpt, tmp_path, "one.jsonl")
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone",
              "--nproc_per_node=2", "-m", "trireme", "generate", "--checkpoint", ckpt,
              "--device", "cpu", "--max-running", "3", "--max-batch-tokens", "24", "--seed", "7"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    files = subprocess.run([*launch, "--input", str(tmp_path / "prompts.jsonl"), "--output",
                            str(tmp_path / "tp.jsonl")], capture_output=True, text=True,
                           timeout=300, env=env)
    assert files.returncode == 0, files.stderr[-3000:]
    assert files.stdout.count("wrote 5 completions") == 1
    assert (tmp_path / "tp.jsonl").read_text() == (tmp_path / "one.jsonl").read_text()
    one = subprocess.run([*launch, "--prompt", "def f(x):", "--max-new-tokens", "10",
                          "--temperature", "0.8", "--top-k", "30", "--seed", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert one.returncode == 0, one.stderr[-3000:]
    assert one.stdout == text + "\n"
