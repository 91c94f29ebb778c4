"""Chunked output layer + cross-entropy (trireme.ops.fused_cross_entropy) against the plain path:
the loss and the gradients of x and the output weight, alone and through the whole GPT."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from trireme.config import ModelConfig
from trireme.errors import TriremeError
from trireme.models.gpt import GPT
from trireme.ops.cross_entropy import cross_entropy
from trireme.ops.fused_cross_entropy import fused_linear_cross_entropy

VOCAB, PADDED, H = 100, 128, 32
# on a GPU machine the same checks run on CUDA too (its bf16 matmuls and the fp32 accumulation)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def inputs(dtype, n=37, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, H, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(PADDED, H, generator=gen) * 0.5).to(device, dtype).requires_grad_()
    labels = torch.randint(0, VOCAB, (n,), generator=gen).to(device)
    labels[::5] = -100
    loss_mask = torch.rand(n, generator=gen).round().to(device)
    loss_mask[1] = 0.5  # weights, not only 0/1
    return x, weight, labels, loss_mask


def plain(x, weight, labels, loss_mask):
    return cross_entropy(F.linear(x, weight)[..., :VOCAB], labels, loss_mask)


def grads(loss_fn, x, weight, scale=1.0):
    x, weight = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    loss = loss_fn(x, weight)
    (loss * scale).backward()
    return loss.detach(), x.grad, weight.grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk_size", [1, 8, 1000])
def test_matches_plain_path(dtype, chunk_size, device):
    x, weight, labels, loss_mask = inputs(dtype, device=device)
    ref = grads(lambda a, w: plain(a, w, labels, loss_mask), x, weight, scale=0.25)
    got = grads(lambda a, w: fused_linear_cross_entropy(
        a, w, labels, loss_mask, vocab_size=VOCAB, chunk_size=chunk_size), x, weight, scale=0.25)
    tol = {} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(got[0], ref[0], **({} if dtype == torch.float32 else
                                                   dict(rtol=1e-3, atol=1e-3)))
    assert got[1].dtype == dtype and got[2].dtype == dtype
    torch.testing.assert_close(got[1], ref[1], **tol)  # d loss / d x
    torch.testing.assert_close(got[2], ref[2], **tol)  # d loss / d weight
    assert got[2][VOCAB:].abs().sum() == 0  # padded rows: no gradient
    if dtype == torch.float32:  # not vacuous: a real gradient reached every real row used
        assert got[2][:VOCAB].abs().sum() > 0


def test_no_token_counts_gives_zero_not_nan():
    x, weight, labels, _ = inputs(torch.float32)
    loss, gx, gw = grads(lambda a, w: fused_linear_cross_entropy(
        a, w, labels, torch.zeros(labels.shape), vocab_size=VOCAB, chunk_size=4), x, weight)
    assert loss.item() == 0.0 and gx.abs().sum() == 0 and gw.abs().sum() == 0


def test_no_grad_gives_the_same_loss():
    x, weight, labels, loss_mask = inputs(torch.float32)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(x, weight, labels, loss_mask, vocab_size=VOCAB,
                                          chunk_size=5)
    torch.testing.assert_close(loss, plain(x, weight, labels, loss_mask))


def test_bad_chunk_size():
    x, weight, labels, _ = inputs(torch.float32)
    with pytest.raises(TriremeError, match="chunk_size"):
        fused_linear_cross_entropy(x, weight, labels, chunk_size=0)


def model_config(**overrides) -> ModelConfig:
    values = dict(
        num_layers=2, hidden_size=H, num_attention_heads=4, num_query_groups=2,
        ffn_hidden_size=48, vocab_size=VOCAB, seq_length=16, tie_embeddings=True,
    )
    return ModelConfig(**{**values, **overrides})


@pytest.mark.parametrize("tied", [True, False])
def test_whole_model_grads_match(tied):
    cfg = model_config(tie_embeddings=tied)  # vocab 100 padded to 128 rows
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, 17), generator=gen)
    tokens, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[0, :4] = -100
    loss_mask = torch.ones(2, 16)
    loss_mask[1, 10:] = 0
    results = []
    for fused in ("false", "true"):
        model = GPT(dataclasses.replace(cfg, fused_cross_entropy=fused, loss_chunk_size=7),
                    seed=5)
        loss = model(tokens, labels, loss_mask=loss_mask)
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_plain, g_plain), (loss_fused, g_fused) = results
    torch.testing.assert_close(loss_fused, loss_plain)
    assert g_plain.keys() == g_fused.keys()
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], msg=name)
    out = "embedding.weight" if tied else "output.weight"
    assert g_fused[out][VOCAB:].abs().sum() == 0 and g_fused[out].abs().sum() > 0


def test_pointwise_chunk_step_matches():
    """The form torch.compile gets on CUDA (no scatter) gives the eager form's numbers."""
    from trireme.ops.fused_cross_entropy import _loss_and_grad, _loss_and_grad_pointwise

    x, weight, labels, loss_mask = inputs(torch.bfloat16)
    logits = (x @ weight[:VOCAB].t()).detach()
    w = torch.rand(labels.shape[0]) * (labels != -100)
    loss, grad = _loss_and_grad(logits, labels, w)
    loss_p, grad_p = _loss_and_grad_pointwise(logits, labels, w)
    torch.testing.assert_close(loss_p, loss)
    assert grad_p.dtype == torch.bfloat16
    torch.testing.assert_close(grad_p, grad)


@pytest.mark.parametrize("pointwise", [False, True])
def test_padded_columns_take_no_part(pointwise):
    """The chunk step over all padded_vocab columns (aligned matmuls) gives the unpadded
    step's loss and gradient, and an exact zero gradient in the padding, even where the padded
    logits are the largest."""
    from trireme.ops.fused_cross_entropy import _loss_and_grad, _loss_and_grad_pointwise

    step = _loss_and_grad_pointwise if pointwise else _loss_and_grad
    x, weight, labels, _ = inputs(torch.float32)
    logits = (x @ weight.t()).detach()  # [n, PADDED]
    logits[:, VOCAB:] += 30.0  # would dominate the softmax if they took part
    w = torch.rand(labels.shape[0]) * (labels != -100)
    loss_ref, grad_ref = step(logits[:, :VOCAB].clone(), labels, w)
    loss, grad = step(logits.clone(), labels, w, VOCAB)
    torch.testing.assert_close(loss, loss_ref)
    torch.testing.assert_close(grad[:, :VOCAB], grad_ref)
    assert grad[:, VOCAB:].abs().sum() == 0 and grad_ref.abs().sum() > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled chunk step is for CUDA")
def test_compiled_chunk_step_on_cuda():
    x, weight, labels, loss_mask = inputs(torch.bfloat16, device="cuda")
    ref = grads(lambda a, w: plain(a, w, labels, loss_mask), x, weight)
    got = grads(lambda a, w: fused_linear_cross_entropy(
        a, w, labels, loss_mask, vocab_size=VOCAB, chunk_size=16, compile=True), x, weight)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-3, atol=1e-3)
    for g, r in zip(got[1:], ref[1:]):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-3)


def saved_bytes(loss_fn) -> int:
    """Bytes of the distinct storages autograd keeps for the backward (leaves left out)."""
    kept: dict[int, int] = {}

    def pack(t):
        if not t.requires_grad or t.grad_fn is not None:  # not a leaf input
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    loss.backward()
    return sum(kept.values())


def test_keeps_no_logits_for_the_backward():
    n, vocab, h = 512, 1000, 16
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, h, generator=gen, requires_grad=True)
    labels = torch.randint(0, vocab, (n,), generator=gen)
    plain_bytes = saved_bytes(lambda: cross_entropy(x @ weight.t(), labels))
    fused_bytes = saved_bytes(lambda: fused_linear_cross_entropy(x, weight, labels, chunk_size=64))
    assert plain_bytes >= n * vocab * 4  # the fp32 log-probabilities
    assert fused_bytes <= (n * h + vocab * h) * 4 + 64  # the gradients of x and W, and a scalar


def test_second_backward_is_refused():
    x, weight, labels, _ = inputs(torch.float32)
    loss = fused_linear_cross_entropy(x, weight, labels, vocab_size=VOCAB, chunk_size=8)
    loss.backward(retain_graph=True)
    with pytest.raises(TriremeError, match="one backward"):
        loss.backward()


@pytest.mark.parametrize("fp8_kernel", [None, "compiled"])
def test_model_hands_the_fp8_kernel_choice_to_the_loss(fp8_kernel, monkeypatch):
    """The fp8 output layer's softmax kernel is its own setting (model.fp8_cross_entropy_kernel,
    triton by default), not fused_cross_entropy_kernel's."""
    import trireme.models.gpt as gpt

    seen = {}

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return fused_linear_cross_entropy(*args, **kwargs)

    monkeypatch.setattr(gpt, "fused_linear_cross_entropy", spy)
    overrides = {"fused_cross_entropy": "true", "fused_cross_entropy_kernel": "compiled"}
    if fp8_kernel is not None:
        overrides["fp8_cross_entropy_kernel"] = fp8_kernel
    model = GPT(model_config(**overrides), seed=5)
    ids = torch.randint(0, VOCAB, (2, 17), generator=torch.Generator().manual_seed(3))
    model(ids[:, :-1], ids[:, 1:]).backward()
    assert seen["softmax_kernel"] == "compiled"
    assert seen["fp8_softmax_kernel"] == (fp8_kernel or "triton")
