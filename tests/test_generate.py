"""generate() (through the serving engine) equals full recomputation; the samplers behave;
`trireme generate` loads the model with no random init, and generates what a fully initialized
model does."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trireme.models.gpt
import trireme.models.init
from trireme.checkpoint.model_state import model_from_state
from trireme.checkpoint.store import load_model_state, save_checkpoint
from trireme.cli import main as cli_main
from trireme.config import Config, ModelConfig
from trireme.data.tokenizer import load_tokenizer
from trireme.errors import TrainingError, TriremeError
from trireme.models.gpt import GPT
from trireme.serving.generate import generate, printable_ids
from trireme.serving.loading import generate_from_checkpoint
from trireme.serving.sampling import sample_next
from trireme.training.build import DTYPES

REPO = Path(__file__).resolve().parents[1]

VOCAB = 100


def gpt2_config(**overrides) -> ModelConfig:
    values = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, seq_length=32,
        position_embedding="learned", normalization="layernorm", activation="gelu", bias=True,
        tie_embeddings=True,
    )
    return ModelConfig(**{**values, **overrides})


def llama_config(**overrides) -> ModelConfig:
    values = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=96, vocab_size=VOCAB, seq_length=32, position_embedding="rope",
        normalization="rmsnorm", activation="swiglu", qk_norm=True,
    )
    return ModelConfig(**{**values, **overrides})


CONFIGS = {
    "gpt2": gpt2_config(),
    "llama-gqa": llama_config(),
    "llama-mqa": llama_config(num_query_groups=1, rope_scaling="llama3"),
}


def _model(cfg: ModelConfig, seed: int = 0) -> GPT:
    model = GPT(cfg, seed=seed).eval()
    with torch.no_grad():  # larger weights than the 0.02 init, so that logits are far from flat
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
    return model


@pytest.mark.parametrize("kind", CONFIGS)
def test_engine_decoding_equals_recomputation(kind):
    """generate() (the serving engine, its paged cache) continues a batch as the argmax of the
    whole sequence recomputed at each token does (the engine's logits, row for row:
    tests/test_serve_engine.py)."""
    model = _model(CONFIGS[kind])
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    ids = prompt
    with torch.no_grad():
        for _ in range(12):
            next_ids = model(ids)[:, -1].argmax(-1, keepdim=True)  # [2, 1]: recomputed
            ids = torch.cat([ids, next_ids], dim=1)
    cached = generate(model, prompt, 12, greedy=True)
    recomputed = generate(model, prompt, 12, greedy=True, use_cache=False)
    assert torch.equal(cached, ids) and torch.equal(recomputed, ids)


def test_sampling_without_a_seed_follows_torch_manual_seed():
    """Without a seed the rows draw from torch's default generator, as before the engine ran
    generate(): torch.manual_seed makes them reproducible."""
    model = _model(gpt2_config(), seed=3)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    runs = []
    for _ in range(2):
        torch.manual_seed(21)
        runs.append(generate(model, prompt, 15, temperature=1.5))
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(21)
    assert torch.equal(runs[0], generate(model, prompt, 15, temperature=1.5, use_cache=False))


@pytest.mark.parametrize("use_cache", [True, False])
@pytest.mark.parametrize("settings", [{"greedy": True}, {"temperature": 0.8, "top_k": 40}])
def test_non_finite_logits_are_a_training_error(use_cache, settings):
    """A model whose weights diverged: one line, whether greedy or sampled (the engine's
    multinomial never sees the NaN rows)."""
    model = _model(llama_config())
    with torch.no_grad():
        model.embedding.weight.fill_(float("nan"))
    with pytest.raises(TrainingError, match="logits are not finite"):
        generate(model, [1, 2, 3], 4, seed=0, use_cache=use_cache, **settings)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    model = _model(llama_config())
    prompt = [3, 14, 15, 92]
    greedy = generate(model, prompt, 10, greedy=True)
    assert greedy.shape == (14,) and greedy[:4].tolist() == prompt
    assert torch.equal(generate(model, prompt, 10, top_k=1, seed=0), greedy)
    assert torch.equal(generate(model, prompt, 10, top_p=1e-6, seed=0), greedy)
    assert torch.equal(generate(model, prompt, 10, temperature=0.0), greedy)


def test_sampling_with_a_seed_is_reproducible():
    model = _model(gpt2_config(), seed=3)
    a = generate(model, [1, 2, 3], 20, temperature=1.5, top_k=50, top_p=0.95, seed=11)
    b = generate(model, [1, 2, 3], 20, temperature=1.5, top_k=50, top_p=0.95, seed=11)
    c = generate(model, [1, 2, 3], 20, temperature=1.5, top_k=50, top_p=0.95, seed=12)
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert torch.equal(a, generate(model, [1, 2, 3], 20, temperature=1.5, top_k=50, top_p=0.95,
                                   seed=11, use_cache=False))


def test_padded_ids_are_never_sampled():
    model = _model(llama_config(), seed=4)  # vocab 100 padded to 128
    with torch.no_grad():  # make the padded rows as attractive as possible
        model.output.weight[VOCAB:] = 100.0 * model.output.weight[:VOCAB].mean(0)
    out = generate(model, torch.zeros(4, 1, dtype=torch.long), 31, temperature=3.0, seed=0)
    assert out.shape == (4, 32)  # stops at seq_length
    assert int(out.max()) < VOCAB


def test_sample_next_filters():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]]).repeat(2000, 1)
    gen = torch.Generator().manual_seed(0)
    top2 = sample_next(logits, top_k=2, generator=gen)
    assert set(top2.tolist()) == {2, 3}
    # probs ~ [.03, .09, .24, .64]: top_p 0.8 keeps {3, 2}, 0.5 keeps {3}
    assert set(sample_next(logits, top_p=0.8, generator=gen).tolist()) == {2, 3}
    assert set(sample_next(logits, top_p=0.5, generator=gen).tolist()) == {3}
    assert set(sample_next(logits, top_p=0.0, generator=gen).tolist()) == {3}


def test_eos_stops_and_pads():
    model = _model(llama_config())
    greedy = generate(model, [5, 6], 10, greedy=True)
    eos = int(greedy[4])  # the third generated token
    out = generate(model, [5, 6], 10, greedy=True, eos_id=eos)
    first = int((out[2:] == eos).nonzero()[0]) + 2
    assert out.shape[0] == first + 1 and torch.equal(out, greedy[: first + 1])


def test_stop_ids_end_a_sequence_without_an_eos_id():
    """generate(stop_ids=...) without eos_id ignored the stop ids (it went on to
    max_new_tokens); they end a sequence as eos_id does, padded with the first."""
    model = _model(llama_config())
    greedy = generate(model, [5, 6], 10, greedy=True)
    stop = int(greedy[4])  # the third generated token
    first = int((greedy[2:] == stop).nonzero()[0]) + 2
    out = generate(model, [5, 6], 10, greedy=True, stop_ids=[stop])
    assert torch.equal(out, greedy[: first + 1])
    assert torch.equal(generate(model, [5, 6], 10, greedy=True, eos_id=stop), out)


def test_prompt_checks():
    model = _model(gpt2_config())
    with pytest.raises(TriremeError, match="seq_length"):
        generate(model, list(range(33)), 1)
    with pytest.raises(TriremeError, match="vocab"):
        generate(model, [VOCAB + 5], 1)
    assert generate(model, list(range(30)), 10, greedy=True).shape == (32,)  # truncated
    assert model.training is False
    model.train()
    generate(model, [1], 2)
    assert model.training  # the mode is restored


@pytest.mark.parametrize("settings, needle", [
    ({"temperature": float("nan")}, "temperature must be a finite number >= 0, got nan"),
    ({"temperature": -1.0}, "temperature must be a finite number >= 0, got -1.0"),
    ({"top_k": -3}, "top_k must be >= 0"),
    ({"top_p": 1.5}, r"top_p must be in \[0, 1\], got 1.5"),
])
def test_sampling_settings_are_checked_as_the_flags_are(settings, needle):
    """generate() from Python took what `trireme generate` refuses: a NaN temperature failed
    mid-generation in torch.multinomial, a negative one sampled greedily without a word."""
    with pytest.raises(TriremeError, match=needle):
        generate(_model(gpt2_config()), [1, 2], 3, **settings)


# --------------------------------------------------------------------------------------------
# Loading a model for generation: built on the meta device, no random init


def _forbid_init(monkeypatch) -> None:
    """Make any random initialization fail (GPT(cfg) with a seed calls init_parameters, which
    draws every value through draw_normal)."""
    def no_init(*args, **kwargs):
        raise AssertionError("a random init ran")

    monkeypatch.setattr(trireme.models.gpt, "init_parameters", no_init)
    monkeypatch.setattr(trireme.models.init, "draw_normal", no_init)


def _fully_initialized(cfg: ModelConfig, state: dict, dtype: torch.dtype) -> GPT:
    """The model as `trireme generate` built it before: a full init on the CPU, then the state."""
    model = GPT(cfg)
    load_model_state(model, state)
    return model.to(device="cpu", dtype=dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", CONFIGS)
def test_model_from_state_runs_no_init_and_equals_a_full_init(kind, dtype, monkeypatch):
    cfg = CONFIGS[kind]
    state = {n: t.clone() for n, t in _model(cfg, seed=5).state_dict().items()}
    ref = _fully_initialized(cfg, state, dtype)
    _forbid_init(monkeypatch)
    with pytest.raises(AssertionError, match="random init"):
        GPT(cfg)  # the guard works
    model = model_from_state(cfg, state, "cpu", dtype).eval()
    got, want = model.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert t.dtype == got[name].dtype and torch.equal(t, got[name]), name
    if cfg.position_embedding == "rope":  # not a parameter: computed when built, on the CPU
        assert model.rope.inv_freq.device.type == "cpu"
        assert torch.equal(model.rope.inv_freq, ref.rope.inv_freq)
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(ids), ref(ids))
    sample = dict(temperature=0.9, top_k=20, seed=3)
    assert torch.equal(generate(model, [1, 2, 3], 12, **sample),
                       generate(ref, [1, 2, 3], 12, **sample))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_trireme_generate_runs_no_init_and_writes_the_same_text(tmp_path, monkeypatch, precision):
    cfg = Config()
    cfg.model = llama_config(vocab_size=257, rope_scaling="llama3")
    cfg.model.precision = precision
    cfg.data.tokenizer = "bytes"
    state = {n: t.clone() for n, t in _model(cfg.model, seed=7).state_dict().items()}
    save_checkpoint(tmp_path, 0, model=state, optimizer={}, trainer={"step": 0},
                    config_toml=cfg.to_toml())
    tok = load_tokenizer("bytes")
    sample = dict(temperature=0.9, top_k=20, seed=3)
    ref = _fully_initialized(cfg.model, state, DTYPES[precision])
    expected = tok.decode(generate(ref, tok.encode("def "), 16, eos_id=tok.eod, **sample).tolist())
    _forbid_init(monkeypatch)
    text = generate_from_checkpoint(str(tmp_path), "def ", max_new_tokens=16, device="cpu",
                                    **sample)
    assert text == expected and len(text) > len("def ")


def test_printed_samples_stop_at_the_end_of_text_token():
    eod = 0
    assert printable_ids([5, 6, 7, 0, 8, 0], 2, eod) == [5, 6, 7]  # stops at the first eod
    assert printable_ids([0, 7, 8], 1, eod) == [7, 8]  # an empty prompt's eod is not shown
    assert printable_ids([5, 6, 7], 2, eod) == [5, 6, 7]


def test_a_missing_checkpoint_names_the_flag(tmp_path):
    with pytest.raises(TriremeError, match="--checkpoint"):
        generate_from_checkpoint(str(tmp_path / "nope"), "def ")


def _saved(tmp_path) -> str:
    cfg = Config()
    cfg.model = llama_config(vocab_size=257)
    cfg.data.tokenizer = "bytes"
    state = {n: t.clone() for n, t in _model(cfg.model, seed=7).state_dict().items()}
    save_checkpoint(tmp_path / "ckpt", 0, model=state, optimizer={}, trainer={"step": 0},
                    config_toml=cfg.to_toml())
    return str(tmp_path / "ckpt")


def test_generate_flags_are_checked_as_the_server_checks_them(tmp_path, capsys):
    ckpt = _saved(tmp_path)
    for flags, needle in [(["--top-p", "1.5"], "--top-p must be in [0, 1]"),
                          (["--temperature", "-1"], "--temperature must be a finite number"),
                          (["--top-k", "-3"], "--top-k must be >= 0"),
                          (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1")]:
        assert cli_main(["generate", "--checkpoint", ckpt, "--prompt", "a", *flags]) == 2
        err = capsys.readouterr().err
        assert needle in err and err.count("\n") == 1, err


def test_a_prompt_that_fills_the_context_is_an_error(tmp_path, capsys):
    """A --prompt of exactly the context's length printed itself and exited 0 (no new token, no
    note); the server refuses it (prompt + at least 1 new token), and so does generate now."""
    ckpt = _saved(tmp_path)  # seq_length 32, one token per byte
    run = ["generate", "--checkpoint", ckpt, "--device", "cpu", "--greedy", "--max-new-tokens"]
    assert cli_main([*run, "4", "--prompt", "a" * 32]) == 2
    err = capsys.readouterr().err
    assert "--prompt has 32 tokens but the model's context is 32" in err and err.count("\n") == 1
    assert cli_main([*run, "4", "--prompt", "a" * 31]) == 0
    printed = capsys.readouterr()
    assert len(printed.out) == 31 + 1 + 1 and "past the model's context (32)" in printed.err


def test_generate_into_a_closed_pipe_exits_quietly(tmp_path):
    """`trireme generate ... | head -c 0`: the reader is gone before the text is printed."""
    proc = subprocess.Popen([sys.executable, "-m", "trireme", "generate", "--checkpoint",
                             _saved(tmp_path), "--prompt", "a", "--max-new-tokens", "4",
                             "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(120) == 141 and "Traceback" not in err and "Broken pipe" not in err, err
