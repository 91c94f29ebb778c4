"""The optional registry kernels behind config switches: model.attention_backend = "fa4"
(trireme.ops.attention_fa4) and model.kernels (trireme.ops.liger).

On the CPU: the switches off and on give today's numbers (trireme's ops run on CPU tensors); a
missing package is a one-line ConfigError at model build; the FA4 custom ops' wiring (layout,
scale, autograd, fake shapes under torch.compile) checked with plain-torch stand-ins for the two
kernels; the liger loss's mask handling. On a GPU with the packages: each kernel against
trireme's reference (skipped elsewhere).
"""

import math

import pytest
import torch
import torch.nn.functional as F

import trireme.ops.attention_fa4 as fa4_module
import trireme.ops.liger as liger_module
from trireme.checkpoint.model_state import expected_shapes
from trireme.checkpoint.store import save_checkpoint
from trireme.config import Config, ModelConfig
from trireme.errors import ConfigError
from trireme.models.gpt import GPT
from trireme.ops.attention import attention, available_backends
from trireme.ops.cross_entropy import cross_entropy
from trireme.serving.loading import generate_from_checkpoint

CUDA = torch.cuda.is_available()


def tiny_config(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=72, vocab_size=100, seq_length=16)
    return ModelConfig(**{**values, **kw})


def loss_and_grads(cfg: ModelConfig, loss_mask: torch.Tensor | None = None):
    model = GPT(cfg, seed=7)
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], ids[:, 1:], loss_mask=loss_mask)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


# ------------------------------------------------------------------- stand-ins for the packages

def _ref_fa_forward(q, k, v, softmax_scale, causal, return_lse=True):
    """FlashAttention's contract in plain torch: [b, s, heads, d] in, (out, lse [b, h, s])."""
    qt, kt, vt = (t.transpose(1, 2).float() for t in (q, k, v))  # [b, heads, s, d]
    groups = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
    scores = qt @ kt.transpose(-2, -1) * softmax_scale  # [b, h, s, s]
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    lse = scores.logsumexp(-1)  # [b, h, s]
    out = (scores.softmax(-1) @ vt).transpose(1, 2).to(q.dtype)  # [b, s, h, d]
    return out, lse


def _ref_fa_backward(q, k, v, out, dout, lse, softmax_scale, causal):
    """The softmax-attention backward by its formulas (a custom op's body runs below autograd):
    P = exp(S - lse), dV = P^T dO, dS = P * (dO V^T - rowsum(dO * O)), dQ = scale dS K,
    dK = scale dS^T Q; dK, dV summed over the query heads that share a key/value head."""
    qt, kt, vt, ot, dot = (t.transpose(1, 2).float() for t in (q, k, v, out, dout))
    n_kv, groups = kt.shape[1], qt.shape[1] // kt.shape[1]
    kr, vr = kt.repeat_interleave(groups, 1), vt.repeat_interleave(groups, 1)
    scores = qt @ kr.transpose(-2, -1) * softmax_scale  # [b, h, s, s]
    if causal:
        size = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(size, size, dtype=torch.bool).triu(1),
                                    float("-inf"))
    p = (scores - lse.unsqueeze(-1)).exp()
    dv = p.transpose(-2, -1) @ dot  # [b, h, s, d]
    ds = p * (dot @ vr.transpose(-2, -1) - (dot * ot).sum(-1, keepdim=True))
    dq = ds @ kr * softmax_scale
    dk = ds.transpose(-2, -1) @ qt * softmax_scale

    def per_kv(t):  # [b, h, s, d] -> [b, s, n_kv, d], summed over each kv head's groups
        b, _, s_, d = t.shape
        return t.view(b, n_kv, groups, s_, d).sum(2).transpose(1, 2).to(k.dtype)

    return dq.transpose(1, 2).to(q.dtype), per_kv(dk), per_kv(dv)


@pytest.fixture
def fake_fa4(monkeypatch):
    monkeypatch.setattr(fa4_module, "_load",
                        lambda: fa4_module.FA4Kernels(_ref_fa_forward, _ref_fa_backward))


@pytest.fixture
def fa4_missing(monkeypatch):
    monkeypatch.setattr(fa4_module, "_load", lambda: "ModuleNotFoundError: No module 'flash_attn'")


@pytest.fixture
def liger_missing(monkeypatch):
    monkeypatch.setattr(liger_module, "_load",
                        lambda: "ModuleNotFoundError: No module named 'liger_kernel'")


@pytest.fixture
def fake_liger(monkeypatch):
    """A liger module whose functions are plain torch (only the loss is called on the CPU)."""
    import types

    module = types.ModuleType("fake_liger_functional")

    def flce(x, w, target, ignore_index=-100, reduction="mean", accum_dtype=None):
        return F.cross_entropy((x @ w.t()).float(), target, ignore_index=ignore_index,
                               reduction=reduction)

    module.liger_fused_linear_cross_entropy = flce
    monkeypatch.setattr(liger_module, "_load", lambda: module)
    return module


# ------------------------------------------------------------------- FA4 on the CPU

def test_a_checkpoint_trained_with_fa4_and_liger_loads_without_them(fa4_missing, liger_missing,
                                                                      tmp_path):
    """The kernels are speed choices: inference and conversion build the model without them."""
    plain = tiny_config(normalization="rmsnorm", activation="swiglu", vocab_size=256)
    state = GPT(plain, seed=3).state_dict()
    answers = []
    for name, kw in (("plain", {}), ("fast", {"attention_backend": "fa4", "kernels": [
            "liger_rmsnorm", "liger_swiglu", "liger_cross_entropy"]})):
        cfg = Config()
        cfg.model, cfg.data.tokenizer = tiny_config(**{**plain.__dict__, **kw}), "bytes"
        save_checkpoint(tmp_path / name, 0, model=state, optimizer={}, trainer={"step": 0},
                        config_toml=cfg.to_toml())
        answers.append(generate_from_checkpoint(str(tmp_path / name), "ab", max_new_tokens=4,
                                                greedy=True, device="cpu"))
        assert expected_shapes(cfg.model) == expected_shapes(plain)
    assert answers[0] == answers[1]
    with pytest.raises(ConfigError, match="flash-attn-4|liger-kernel"):
        GPT(cfg.model)  # training still asks for the packages

def test_fa4_missing_is_a_clear_error_at_build(fa4_missing):
    with pytest.raises(ConfigError, match="flash-attn-4.*trireme\\[fa4\\].*'auto'") as e:
        GPT(tiny_config(attention_backend="fa4"))
    assert "\n" not in str(e.value)


def test_fa4_off_cpu_is_the_auto_path(fake_fa4):
    """On CPU tensors "fa4" is the SDPA auto path: the same loss and gradients, bit for bit."""
    loss_ref, grads_ref = loss_and_grads(tiny_config())
    loss, grads = loss_and_grads(tiny_config(attention_backend="fa4"))
    assert torch.equal(loss, loss_ref)
    for name, g in grads_ref.items():
        assert torch.equal(grads[name], g), name
    assert "fa4" not in available_backends("cpu")


def test_fa4_attention_call_on_cpu_without_the_package(fa4_missing):
    q, k = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8)
    assert torch.equal(attention(q, k, k, backend="fa4"), attention(q, k, k, backend="auto"))


@pytest.mark.parametrize("causal", [True, False])
def test_fa4_ops_wiring_forward_backward(fake_fa4, causal):
    """fa4_attention through the custom ops (stand-in kernels) equals the reference attention,
    output and q, k, v gradients, for GQA; the views it returns are [b, heads, s, d]."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 4, 8, generator=gen)  # [b, s, heads, d]: the model's projection layout
    k, v = torch.randn(2, 6, 2, 8, generator=gen), torch.randn(2, 6, 2, 8, generator=gen)
    dy = torch.randn(2, 4, 6, 8, generator=gen)

    def run(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        y = fn(*(t.transpose(1, 2) for t in leaves))  # [b, heads, s, d] views
        y.backward(dy)
        return y.detach(), [t.grad for t in leaves]

    y_ref, g_ref = run(lambda a, b, c: attention(a, b, c, causal=causal, backend="reference"))
    y, g = run(lambda a, b, c: fa4_module.fa4_attention(a, b, c, causal))
    assert y.shape == y_ref.shape == (2, 4, 6, 8)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=0)
    for got, want in zip(g, g_ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_fa4_takes_only_the_head_sizes_and_gpus_it_supports(fake_fa4, monkeypatch):
    """Other head sizes, and GPUs older than compute capability 9.0, take the auto path."""
    calls = []
    forward = fa4_module._load().forward
    monkeypatch.setattr(fa4_module, "_load", lambda: fa4_module.FA4Kernels(
        lambda *a, **kw: calls.append(1) or forward(*a, **kw), _ref_fa_backward))
    monkeypatch.setattr(fa4_module, "_on_fa4_gpu", lambda q: True)  # as if on an H100 / H200
    for d, taken in ((8, True), (64, True), (256, True), (12, False), (160, False)):
        gen = torch.Generator().manual_seed(d)
        q = torch.randn(1, 4, 6, d, generator=gen).bfloat16()
        k = torch.randn(1, 2, 6, d, generator=gen).bfloat16()
        calls.clear()
        y = attention(q, k, k, backend="fa4")
        assert bool(calls) == taken == fa4_module.fa4_head_size_ok(d), d
        want = attention(q, k, k, backend="reference")
        torch.testing.assert_close(y.float(), want.float(), atol=2e-2, rtol=0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    assert not fa4_module._capability_ok.__wrapped__(torch.device("cuda", 0))  # A100: auto
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert fa4_module._capability_ok.__wrapped__(torch.device("cuda", 0))


def test_fa4_ops_trace_under_compile(fake_fa4):
    """torch.compile takes the custom ops whole (fake shapes, no graph break)."""
    torch._dynamo.reset()
    q = torch.randn(1, 5, 4, 8).transpose(1, 2).requires_grad_()
    k = torch.randn(1, 5, 2, 8).transpose(1, 2).requires_grad_()
    compiled = torch.compile(lambda a, b: fa4_module.fa4_attention(a, b, b).sum(),
                             backend="aot_eager", fullgraph=True)
    loss = compiled(q, k)
    loss.backward()
    want = attention(q.detach(), k.detach(), k.detach(), backend="reference").sum()
    torch.testing.assert_close(loss.detach(), want, atol=1e-5, rtol=0)
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


# ------------------------------------------------------------------- liger on the CPU

def test_liger_missing_is_a_clear_error_at_build(liger_missing):
    for kernel in ("liger_rmsnorm", "liger_swiglu", "liger_cross_entropy"):
        with pytest.raises(ConfigError, match=f"{kernel}.*liger-kernel.*trireme\\[liger\\]") as e:
            GPT(tiny_config(kernels=[kernel]))
        assert "\n" not in str(e.value)


def test_liger_switch_on_cpu_is_todays_model(fake_liger):
    """Every liger kernel named, on CPU tensors: trireme's ops run, the same numbers bit for bit
    (also with fused_cross_entropy forced on, the path the liger loss would replace)."""
    names = ["liger_rmsnorm", "liger_swiglu", "liger_cross_entropy"]
    for extra in ({}, {"fused_cross_entropy": "true"}):
        loss_ref, grads_ref = loss_and_grads(tiny_config(**extra))
        loss, grads = loss_and_grads(tiny_config(kernels=names, **extra))
        assert torch.equal(loss, loss_ref)
        for name, g in grads_ref.items():
            assert torch.equal(grads[name], g), name
    model = GPT(tiny_config(kernels=names))
    assert model.final_norm.liger and model.layers["0"].mlp.liger_swiglu and model.liger_loss


def test_liger_loss_folds_a_binary_mask(fake_liger):
    """The mask becomes ignored labels: the same mean as trireme's cross_entropy with the mask."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 8, generator=gen), torch.randn(11, 8, generator=gen)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    labels[0, 1] = -100
    mask = (torch.rand(2, 5, generator=gen) > 0.4).float()
    mask[1, 0] = 1.0
    want = cross_entropy(x @ w.t(), labels, mask)
    assert liger_module.liger_loss_applies(labels, mask)
    torch.testing.assert_close(liger_module.liger_linear_cross_entropy(x, w, labels, mask), want)


def test_liger_loss_applies():
    labels = torch.tensor([[1, 2, -100]])
    assert liger_module.liger_loss_applies(labels, None)
    assert liger_module.liger_loss_applies(labels, torch.tensor([[True, False, True]]))
    assert not liger_module.liger_loss_applies(labels, torch.tensor([[0.5, 1.0, 1.0]]))
    assert not liger_module.liger_loss_applies(labels, torch.tensor([[0.0, 0.0, 1.0]]))  # none
    assert not liger_module.liger_loss_applies(torch.full((1, 3), -100), None)


def test_kernels_config_validation():
    from trireme.config import Config, validate

    cfg = Config()
    cfg.model = tiny_config(kernels=["liger_rope"])
    with pytest.raises(ConfigError, match="unknown kernel.*liger_rope"):
        validate(cfg)
    cfg.model = tiny_config(kernels=["liger_swiglu"], fused_swiglu=True)
    with pytest.raises(ConfigError, match="liger_swiglu.*fused_swiglu"):
        validate(cfg)


# ------------------------------------------------------------------- on the GPU

def _has(module: str) -> bool:
    try:
        __import__(module)
    except Exception:
        return False
    return True


needs_fa4 = pytest.mark.skipif(not (CUDA and fa4_module.fa4_available()),
                               reason="needs CUDA and flash-attn-4")
needs_liger = pytest.mark.skipif(not (CUDA and _has("liger_kernel")),
                                 reason="needs CUDA and liger-kernel")


@needs_fa4
@pytest.mark.parametrize("compiled", [False, True])
def test_fa4_matches_reference_cuda(compiled):
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, s, n, kv, d = 2, 256, 8, 2, 64
    qkv = torch.randn(b, s, (n + 2 * kv) * d, generator=gen, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(b, n, s, d, generator=gen, device="cuda", dtype=torch.bfloat16)

    def run(backend):
        leaf = qkv.clone().requires_grad_()
        q, k, v = leaf.split([n * d, kv * d, kv * d], dim=-1)  # the model's strided views
        q, k, v = (t.view(b, s, -1, d).transpose(1, 2) for t in (q, k, v))
        fn = lambda a, c, e: attention(a, c, e, backend=backend)  # noqa: E731
        if compiled and backend == "fa4":
            torch._dynamo.reset()
            fn = torch.compile(fn, fullgraph=True)
        y = fn(q, k, v)
        y.backward(dy)
        return y.float(), leaf.grad.float()

    y_ref, g_ref = run("reference")
    y, g = run("fa4")
    assert (y - y_ref).abs().max() < 2e-2  # outputs are averages of values ~ N(0, 1)
    assert (g - g_ref).norm() / g_ref.norm() < 2e-2  # bf16 rounding, relative


@needs_liger
def test_liger_kernels_match_ours_cuda():
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 256, generator=gen, device="cuda", dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(256, generator=gen, device="cuda")).to(torch.bfloat16)
    for ours, theirs in [(lambda a: F.rms_norm(a, (256,), w, 1e-5),
                          lambda a: liger_module.liger_rms_norm(a, w, 1e-5)),
                         (lambda a: F.silu(a.chunk(2, -1)[0]) * a.chunk(2, -1)[1],
                          liger_module.liger_swiglu)]:
        a1, a2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = ours(a1), theirs(a2)
        dy = torch.randn(y1.shape, generator=gen, device="cuda", dtype=y1.dtype)
        y1.backward(dy)
        y2.backward(dy)
        assert (y1.float() - y2.float()).abs().max() < 3e-2
        assert (a1.grad.float() - a2.grad.float()).abs().max() < 3e-2
    h = torch.randn(128, 64, generator=gen, device="cuda", dtype=torch.bfloat16)
    vocab_w = torch.randn(1000, 64, generator=gen, device="cuda", dtype=torch.bfloat16) / 8
    labels = torch.randint(0, 1000, (128,), generator=gen, device="cuda")
    want = cross_entropy((h @ vocab_w.t()).float(), labels)
    got = liger_module.liger_linear_cross_entropy(h, vocab_w, labels)
    assert math.isclose(got.item(), want.item(), rel_tol=1e-2)


def _gpu_loss_and_grads(**kw):
    cfg = tiny_config(hidden_size=256, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=512, vocab_size=1000, seq_length=128, compile=True, **kw)
    model = GPT(cfg, seed=7).cuda().to(torch.bfloat16).train()
    torch._dynamo.reset()
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                        generator=torch.Generator().manual_seed(0)).cuda()
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("switch", [
    pytest.param({"attention_backend": "fa4"}, marks=needs_fa4, id="fa4"),
    pytest.param({"kernels": ["liger_rmsnorm", "liger_swiglu", "liger_cross_entropy"]},
                 marks=needs_liger, id="liger"),
])
def test_compiled_model_with_switch_cuda(switch):
    """A compiled bf16 model on the GPU: the switch on gives trireme's loss and gradients within
    bf16 rounding."""
    loss_ref, grads_ref = _gpu_loss_and_grads()
    loss, grads = _gpu_loss_and_grads(**switch)
    assert math.isclose(loss.item(), loss_ref.item(), rel_tol=1e-2)
    for name, g in grads_ref.items():
        rel = (grads[name] - g).norm() / g.norm().clamp(min=1e-12)
        assert rel < 5e-2, (name, rel.item())
