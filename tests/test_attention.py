"""Every attention backend agrees with the plain-PyTorch reference, including KV-cache offsets."""

import pytest
import torch

from trireme.errors import ConfigError
from trireme.ops.attention import BACKENDS, attention, available_backends, causal_mask

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
# (n_heads, n_kv): MHA, GQA, MQA
HEADS = [(4, 4), (4, 2), (4, 1)]
# (s_q, s_k, q_offset): full causal, one-token decode, a chunk appended to a cache, a prefix query
CASES = [(12, 12, 0), (1, 12, 11), (5, 12, 7), (5, 12, 0)]


def _backend_params():
    params = []
    for device in DEVICES:
        dtype = torch.float32 if device == "cpu" else torch.bfloat16
        for backend in BACKENDS:
            if backend != "reference":
                params.append(pytest.param(device, dtype, backend, id=f"{device}-{backend}"))
    return params


@pytest.mark.parametrize("device,dtype,backend", _backend_params())
@pytest.mark.parametrize("n_heads,n_kv", HEADS)
@pytest.mark.parametrize("s_q,s_k,q_offset", CASES)
def test_backend_matches_reference(device, dtype, backend, n_heads, n_kv, s_q, s_k, q_offset):
    if backend not in available_backends(device, dtype, gqa=n_heads != n_kv):
        pytest.skip(f"{backend} does not run on {device} for {dtype} (gqa: {n_heads != n_kv})")
    gen = torch.Generator().manual_seed(0)
    d = 64 if device == "cuda" else 16
    q = torch.randn(2, n_heads, s_q, d, generator=gen).to(device, dtype)
    k = torch.randn(2, n_kv, s_k, d, generator=gen).to(device, dtype)
    v = torch.randn(2, n_kv, s_k, d, generator=gen).to(device, dtype)
    expected = attention(q, k, v, backend="reference", q_offset=q_offset)
    try:
        got = attention(q, k, v, backend=backend, q_offset=q_offset)
    except RuntimeError as e:
        if device == "cuda" and s_q not in (1, s_k):  # a mask, or bottom-right alignment
            pytest.skip(f"{backend} cannot take this mask on this GPU: {str(e)[:80]}")
        raise
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=atol, rtol=0)


def test_reference_is_softmax_attention():
    # one head, two keys: the second query sees both keys, the first only the first key
    q = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # [1, 1, 2, 2]
    k = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    v = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    out = attention(q, k, v, backend="reference")
    w = torch.softmax(torch.tensor([0.0, 1.0]) / 2**0.5, dim=0)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], w @ v[0, 0])


def test_causal_mask_with_offset():
    mask = causal_mask(2, 4, q_offset=2)
    assert mask.tolist() == [[True, True, True, False], [True, True, True, True]]


def test_non_causal_and_gqa_without_copies():
    q, k = torch.randn(1, 6, 5, 8), torch.randn(1, 2, 7, 8)
    got = attention(q, k, k, causal=False, backend="auto")
    expected = attention(q, k, k, causal=False, backend="reference")
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_unknown_backend_and_bad_heads():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(ConfigError, match="not one of"):
        attention(q, q, q, backend="fastest")
    with pytest.raises(ValueError, match="multiple"):
        attention(q, torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8))


def test_available_backends_on_cpu():
    usable = available_backends("cpu")
    assert "math" in usable and "reference" in usable and "auto" in usable
    assert "cudnn" not in usable  # a GPU-only kernel


def test_dropout_only_changes_output_when_asked():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 8, 8)
    clean = attention(q, q, q, dropout_p=0.0)
    assert torch.equal(clean, attention(q, q, q, dropout_p=0.0))
    assert not torch.allclose(clean, attention(q, q, q, dropout_p=0.5))


@pytest.mark.parametrize("per_sample", [False, True])
def test_heads_rotates_q_and_k_together_as_each_alone(per_sample):
    """Attention.heads RoPEs q and k as one view of qkv (fewer kernels): the values and the
    gradients are exactly those of rotating each on its own, for positions shared by the batch
    ([s, d] tables) and per sample ([b, s, d])."""
    from trireme.config import ModelConfig
    from trireme.models.attention import Attention
    from trireme.ops.rope import RotaryEmbedding, apply_rotary, rope_frequencies
    from trireme.parallel.context import ParallelContext

    cfg = ModelConfig(hidden_size=64, num_attention_heads=4, num_query_groups=2, num_layers=1,
                      vocab_size=32, seq_length=16, ffn_hidden_size=64)
    layer = Attention(cfg, ParallelContext())
    d, h, n_kv = layer.head_size, layer.num_heads, layer.num_kv_heads
    table = RotaryEmbedding(d, 64, rope_frequencies(d))
    b, s = 3, 7
    positions = torch.randint(0, 60, (b, s)) if per_sample else None
    rope = table(torch.device("cpu"), position_ids=positions) if per_sample else table(
        torch.device("cpu"), offset=5, length=s)
    qkv = torch.randn(b, s, (h + 2 * n_kv) * d, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = layer.heads(qkv, rope)
    q_part, k_part, _ = qkv.split(layer.split_sizes, dim=-1)
    want_q = apply_rotary(q_part.view(b, s, h, d).transpose(1, 2), *rope)
    want_k = apply_rotary(k_part.view(b, s, n_kv, d).transpose(1, 2), *rope)
    assert q.shape == want_q.shape and k.shape == want_k.shape and v.shape == (b, n_kv, s, d)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    grads = [torch.randn_like(t) for t in (q, k)]
    got = torch.autograd.grad([q, k], qkv, grads)[0]
    want = torch.autograd.grad([want_q, want_k], qkv, grads)[0]
    assert torch.equal(got, want)
