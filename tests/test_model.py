"""The GPT model: shapes, loss, vocabulary padding, initialization, training, RoPE, dropout."""

import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from trireme.config import ModelConfig
from trireme.errors import TriremeError
from trireme.models.gpt import GPT
from trireme.models.init import draw_normal, init_parameters
from trireme.ops.rope import RotaryEmbedding, apply_rotary, rope_frequencies

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
        normalization="rmsnorm", activation="swiglu", qk_norm=True, tie_embeddings=False,
    )
    return ModelConfig(**{**values, **overrides})


CONFIGS = {"gpt2": gpt2_config, "llama": llama_config}


def batch(b=2, s=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (b, s + 1), generator=gen)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize("kind", CONFIGS)
def test_forward_shapes_and_loss(kind):
    model = GPT(CONFIGS[kind]())
    inputs, labels = batch()
    logits = model(inputs)
    assert logits.shape == (2, 16, VOCAB)  # the real vocabulary, not the padded 128
    loss = model(inputs, labels)
    assert loss.dim() == 0 and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
    torch.testing.assert_close(loss, expected)
    assert abs(loss.item() - math.log(VOCAB)) < 0.5  # a fresh model is close to uniform


def test_loss_mask_and_ignore_index():
    model = GPT(llama_config())
    inputs, labels = batch()
    labels = labels.clone()
    labels[0, :3] = -100
    loss_mask = torch.ones(2, 16)
    loss_mask[1, 8:] = 0
    logits = model(inputs)
    per_token = F.cross_entropy(
        logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none", ignore_index=-100
    )
    keep = (labels.reshape(-1) != -100) & (loss_mask.reshape(-1) == 1)
    expected = per_token[keep].mean()
    torch.testing.assert_close(model(inputs, labels, loss_mask=loss_mask), expected)
    none_count = model(inputs, labels, loss_mask=torch.zeros(2, 16))
    assert none_count.item() == 0.0  # no token counts: 0, not NaN


@pytest.mark.parametrize("kind", CONFIGS)
def test_padded_vocab_changes_nothing(kind):
    unpadded = GPT(CONFIGS[kind](make_vocab_size_divisible_by=1), seed=7)
    padded = GPT(CONFIGS[kind](make_vocab_size_divisible_by=128), seed=7)
    assert unpadded.embedding.weight.shape[0] == VOCAB
    assert padded.embedding.weight.shape[0] == 128
    for name, p in unpadded.named_parameters():
        assert torch.equal(padded.get_parameter(name)[: p.shape[0]], p), name
    assert padded.output_weight()[VOCAB:].abs().sum() == 0
    inputs, labels = batch()
    loss = padded(inputs, labels)
    torch.testing.assert_close(loss, unpadded(inputs, labels), atol=1e-6, rtol=0)
    with torch.no_grad():  # whatever sits in the padded rows, they never reach the loss
        padded.output_weight()[VOCAB:] = 1e4
    torch.testing.assert_close(padded(inputs, labels), loss, atol=1e-6, rtol=0)


def test_init_depends_only_on_seed_and_name():
    cfg = llama_config(scaled_init=False)
    torch.manual_seed(1)
    a = GPT(cfg, seed=5)
    torch.manual_seed(2)
    _ = torch.randn(100)  # a different global RNG state and history
    b = GPT(llama_config(num_layers=3, scaled_init=False), seed=None)
    for name in reversed([n for n, _ in b.named_parameters()]):  # as if built in another order
        with torch.no_grad():
            b.get_parameter(name).normal_()
    init_parameters(b, seed=5)
    common = dict(a.named_parameters())
    for name, p in b.named_parameters():
        if name in common:
            assert torch.equal(common.pop(name), p), name
    assert not common  # every parameter of the 2-layer model exists in the 3-layer one
    c = GPT(cfg, seed=6)
    for (name, p), q in zip(a.named_parameters(), c.parameters()):
        if "norm" not in name:
            assert not torch.equal(p, q), name


def test_fused_weights_draw_their_parts_separately():
    cfg = llama_config()
    model = GPT(cfg, seed=3)
    qkv = model.get_parameter("layers.1.attention.qkv.weight")
    q_rows, kv_rows = 4 * 16, 2 * 16
    name = "layers.1.attention.qkv.weight"
    assert torch.equal(qkv[:q_rows], draw_normal(3, f"{name}/q", (q_rows, 64), 0.02))
    assert torch.equal(qkv[q_rows + kv_rows :], draw_normal(3, f"{name}/v", (kv_rows, 64), 0.02))
    fc1 = model.get_parameter("layers.0.mlp.fc1.weight")
    assert torch.equal(fc1[96:], draw_normal(3, "layers.0.mlp.fc1.weight/up", (96, 64), 0.02))
    out = model.get_parameter("layers.0.attention.out.weight")
    assert out.std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.1)  # scaled init
    assert torch.all(model.get_parameter("layers.0.attention.q_norm.weight") == 1)


def test_parameter_names_and_counts():
    gpt2 = GPT(gpt2_config())
    names = {n for n, _ in gpt2.named_parameters()}
    assert {"embedding.weight", "position_embedding.weight", "layers.1.attention.qkv.bias",
            "layers.1.mlp.fc2.weight", "final_norm.bias"} <= names
    assert "output.weight" not in names  # tied
    llama = GPT(llama_config())
    names = {n for n, _ in llama.named_parameters()}
    assert "output.weight" in names and "layers.0.attention.k_norm.weight" in names
    assert not any(n.endswith(".bias") for n in names)
    h, q, kv, ffn, layers = 64, 64, 32, 96, 2
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * ffn + 2 * h + 2 * 16
    expected = layers * per_layer + 2 * 128 * h + h
    assert llama.num_parameters() == expected
    assert llama.num_parameters(exclude_embedding=True) == expected - 128 * h


@pytest.mark.parametrize("kind", CONFIGS)
def test_a_few_adam_steps_reduce_the_loss(kind):
    torch.manual_seed(0)
    model = GPT(CONFIGS[kind](), seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    inputs, labels = batch(b=4, s=16)
    losses = []
    for _ in range(15):
        loss = model(inputs, labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.7 * losses[0], losses
    assert model.embedding.weight.grad[VOCAB:].abs().sum() == 0  # padding gets no gradient


def test_llama3_rope_scaling_by_hand():
    theta, factor, low, high, old = 500000.0, 8.0, 1.0, 4.0, 8192
    inv = rope_frequencies(128, theta, "llama3", factor, low, high, old)
    base = [theta ** (-2 * i / 128) for i in range(64)]
    assert inv[0].item() == pytest.approx(base[0])  # wavelength 2*pi: high frequency, unchanged
    assert inv[63].item() == pytest.approx(base[63] / factor)  # very long wavelength: / factor
    # i = 32: inv = 500000^-0.5, wavelength = 2*pi*707.1 = 4443, between 8192/4 and 8192/1
    wavelength = 2 * math.pi / base[32]
    assert old / high < wavelength < old / low
    smooth = (old / wavelength - low) / (high - low)
    assert inv[32].item() == pytest.approx((1 - smooth) * base[32] / factor + smooth * base[32])
    unscaled = rope_frequencies(128, theta)
    assert torch.equal(inv[:10], unscaled[:10])


def test_rope_depends_on_relative_position():
    rope = RotaryEmbedding(16, 64, rope_frequencies(16))
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)

    def score(pos_q, pos_k):
        cq, sq = rope(torch.device("cpu"), offset=pos_q, length=1)
        ck, sk = rope(torch.device("cpu"), offset=pos_k, length=1)
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(3, 1), score(40, 38))
    cos, sin = rope(torch.device("cpu"), position_ids=torch.tensor([[3, 5]]))
    assert cos.shape == (1, 2, 16)
    torch.testing.assert_close(cos[0, 1], rope(torch.device("cpu"), offset=5, length=1)[0][0])


def test_dropout_only_in_training():
    model = GPT(llama_config(dropout=0.2), seed=1)
    reference = GPT(llama_config(dropout=0.0), seed=1)
    inputs, _ = batch()
    model.train()
    assert not torch.allclose(model(inputs), model(inputs))
    model.eval()
    torch.testing.assert_close(model(inputs), model(inputs))
    torch.testing.assert_close(model(inputs), reference.eval()(inputs))
    # p = 0: no dropout modules at all (identities), p > 0: every residual branch has one
    assert not any(isinstance(m, torch.nn.Dropout) for m in reference.modules())
    assert sum(isinstance(m, torch.nn.Dropout) for m in model.modules()) >= 2 * len(model.layers)


def test_learned_positions_reject_long_inputs():
    model = GPT(gpt2_config())
    with pytest.raises(TriremeError, match="seq_length"):
        model(torch.zeros(1, 33, dtype=torch.long))


def _hf_llama_config(transformers, cfg: ModelConfig):
    rope = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    kwargs = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        intermediate_size=cfg.ffn_size, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_length, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=False,
    )
    if "rope_parameters" in inspect.signature(transformers.LlamaConfig.__init__).parameters:
        kwargs["rope_parameters"] = {**rope, "rope_theta": cfg.rope_theta}  # transformers >= 5
    else:
        kwargs.update(rope_theta=cfg.rope_theta, rope_scaling=rope)
    return transformers.LlamaConfig(**kwargs)


def test_matches_hf_llama():
    transformers = pytest.importorskip("transformers")
    cfg = llama_config(
        qk_norm=False, rope_scaling="llama3", rope_scaling_factor=4.0,
        rope_original_max_position=64, rope_theta=10000.0,
    )
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(_hf_llama_config(transformers, cfg)).eval()
    model = GPT(cfg, seed=None).eval()
    sd = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}
    with torch.no_grad():
        model.embedding.weight.zero_()
        model.embedding.weight[:VOCAB] = sd["embed_tokens.weight"]
        model.output.weight.zero_()
        model.output.weight[:VOCAB] = sd["lm_head.weight"]
        model.final_norm.weight.copy_(sd["norm.weight"])
        for i in range(cfg.num_layers):
            hf_layer, layer = f"layers.{i}.", model.layers[str(i)]
            a = hf_layer + "self_attn."
            qkv = [sd[a + f"{x}_proj.weight"] for x in "qkv"]  # [q; k; v] rows
            layer.attention.qkv.weight.copy_(torch.cat(qkv))
            layer.attention.out.weight.copy_(sd[a + "o_proj.weight"])
            m = hf_layer + "mlp."
            fc1 = [sd[m + "gate_proj.weight"], sd[m + "up_proj.weight"]]  # [gate; up] rows
            layer.mlp.fc1.weight.copy_(torch.cat(fc1))
            layer.mlp.fc2.weight.copy_(sd[m + "down_proj.weight"])
            layer.attention_norm.weight.copy_(sd[hf_layer + "input_layernorm.weight"])
            layer.mlp_norm.weight.copy_(sd[hf_layer + "post_attention_layernorm.weight"])
        inputs, _ = batch(s=32)
        expected = hf(inputs).logits
        torch.testing.assert_close(model(inputs), expected, atol=1e-4, rtol=1e-4)


def test_matches_hf_gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = gpt2_config()
    hf_cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=cfg.seq_length, n_embd=64, n_layer=2, n_head=4,
        activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(hf_cfg).eval()
    model = GPT(cfg, seed=None).eval()
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items()}
    with torch.no_grad():
        model.embedding.weight.zero_()
        model.embedding.weight[:VOCAB] = sd["wte.weight"]
        model.position_embedding.weight.copy_(sd["wpe.weight"])
        model.final_norm.weight.copy_(sd["ln_f.weight"])
        model.final_norm.bias.copy_(sd["ln_f.bias"])
        for i in range(cfg.num_layers):
            layer = model.layers[str(i)]
            ours_from_hf = {  # HF's Conv1D stores [in, out]: transpose the weights
                "attention.qkv": "attn.c_attn", "attention.out": "attn.c_proj",
                "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
                "attention_norm": "ln_1", "mlp_norm": "ln_2",
            }
            for ours, theirs in ours_from_hf.items():
                w, b = sd[f"h.{i}.{theirs}.weight"], sd[f"h.{i}.{theirs}.bias"]
                layer.get_parameter(f"{ours}.weight").copy_(w if w.dim() == 1 else w.T)
                layer.get_parameter(f"{ours}.bias").copy_(b)
        inputs, _ = batch(s=32)
        torch.testing.assert_close(model(inputs), hf(inputs).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mode,want", [("default", None),
                                       ("max-autotune-no-cudagraphs",
                                        "max-autotune-no-cudagraphs")])
def test_blocks_compile_once_with_the_configured_mode(mode, want, monkeypatch):
    """On a GPU each block is compiled once when training starts, with model.compile_mode
    (default: torch's own); generation and the CPU stay eager (no GPU needed: compile is
    recorded, not run)."""
    model = GPT(ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=2,
                            ffn_hidden_size=64, vocab_size=64, seq_length=16, compile_mode=mode))
    calls = []
    for block in model.layers.values():
        monkeypatch.setattr(block, "compile", lambda **kw: calls.append(kw))
    model._maybe_compile(torch.device("cpu"))
    model.eval()._maybe_compile(torch.device("cuda"))
    assert calls == []
    model.train()._maybe_compile(torch.device("cuda"))
    model._maybe_compile(torch.device("cuda"))
    assert calls == [{"mode": want}] * 2
