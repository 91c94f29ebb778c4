"""model.fused_swiglu (trireme.ops.swiglu): the fused SwiGLU against the plain one, op by op and
in a whole model; its Triton kernel on the CPU through Triton's interpreter."""

import textwrap

import pytest
import torch
from interpreted import run_in_interpreter

import trireme.ops.swiglu as swiglu_module
from trireme.config import ModelConfig
from trireme.models.gpt import GPT
from trireme.ops.swiglu import fused_swiglu, swiglu, swiglu_backward, swiglu_backward_reference


def value_and_grad(fn, h: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    h = h.detach().clone().requires_grad_()
    y = fn(h)
    y.backward(dy)
    return y, h.grad


def random_inputs(shape, ffn, dtype, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h = (2 * torch.randn(*shape, 2 * ffn, generator=gen)).to(dtype)  # gate spans silu's bend
    dy = torch.randn(*shape, ffn, generator=gen).to(dtype)
    return h, dy


@pytest.mark.parametrize("shape,ffn", [((16,), 64), ((2, 5), 72), ((3, 1, 7), 33)])
def test_fused_matches_plain_fp32(shape, ffn):
    h, dy = random_inputs(shape, ffn, torch.float32)
    y_ref, dh_ref = value_and_grad(swiglu, h, dy)
    y, dh = value_and_grad(fused_swiglu, h, dy)
    assert torch.equal(y, y_ref)  # the same torch ops
    assert dh.shape == h.shape and dh.dtype == h.dtype
    torch.testing.assert_close(dh, dh_ref, rtol=1e-6, atol=1e-6)
    # not vacuous: both halves are there, each in its place (swapped halves would not pass)
    f = ffn
    assert not torch.allclose(dh[..., :f], dh_ref[..., f:], atol=1e-3)


def test_fused_matches_plain_bf16():
    """bf16: the plain path rounds silu(gate) and dy * up to bf16 before multiplying; the fused
    one rounds once. Both are within a few bf16 ulps of the fp32 gradient, the fused one closer."""
    h, dy = random_inputs((4, 9), 72, torch.bfloat16)
    y_ref, dh_ref = value_and_grad(swiglu, h, dy)
    y, dh = value_and_grad(fused_swiglu, h, dy)
    assert torch.equal(y, y_ref)
    assert dh.dtype == torch.bfloat16
    _, dh32 = value_and_grad(swiglu, h.float(), dy.float())  # exact up to fp32
    scale = dh32.abs() + 1e-3
    err_fused = ((dh.float() - dh32).abs() / scale).max().item()
    err_plain = ((dh_ref.float() - dh32).abs() / scale).max().item()
    assert err_fused <= 2**-8  # one rounding: half an ulp (2^-8 relative)
    assert err_plain < 4 * 2**-8
    torch.testing.assert_close(dh, dh_ref, rtol=2 * 2**-7, atol=1e-2)


def test_backward_is_the_formula():
    h, dy = random_inputs((5,), 40, torch.float32, seed=1)
    gate, up = h[:, :40].double(), h[:, 40:].double()
    s = torch.sigmoid(gate)
    expected = torch.cat([dy * up * s * (1 + gate * (1 - s)), dy * gate * s], dim=-1)
    torch.testing.assert_close(swiglu_backward(h, dy).double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(swiglu_backward_reference(h, dy).double(), expected, rtol=1e-5,
                               atol=1e-6)
    # the custom op's fake implementation gives the real shape and dtype
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = swiglu_backward(mode.from_tensor(h), mode.from_tensor(dy))
    assert fake.shape == h.shape and fake.dtype == h.dtype and fake.is_contiguous()


def test_tensor_parallel_halves():
    """Two ranks' h = [gate_r; up_r] (the column-parallel fc1 split): each rank's result is its
    share of the full one, and so are the gradients."""
    ffn = 48
    h, dy = random_inputs((6,), ffn, torch.float32, seed=2)
    y, dh = value_and_grad(fused_swiglu, h, dy)
    gate, up = h.chunk(2, dim=-1)
    half = ffn // 2
    for r in range(2):
        cols = slice(r * half, (r + 1) * half)
        h_r = torch.cat([gate[:, cols], up[:, cols]], dim=-1)  # [6, 2 * half]
        y_r, dh_r = value_and_grad(fused_swiglu, h_r, dy[:, cols])
        torch.testing.assert_close(y_r, y[:, cols], rtol=1e-6, atol=1e-6)  # CPU vector tails
        dgate_r, dup_r = dh_r.chunk(2, dim=-1)
        torch.testing.assert_close(dgate_r, dh[:, :ffn][:, cols], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dup_r, dh[:, ffn:][:, cols], rtol=1e-6, atol=1e-6)


def test_keeps_only_h():
    h, dy = random_inputs((4,), 32, torch.float32)
    h.requires_grad_()
    saved = {}
    for name, fn in (("plain", swiglu), ("fused", fused_swiglu)):
        kept = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, kept=kept: kept.append(t) or t,
                                                      lambda t: t):
            fn(h).backward(dy)
        saved[name] = {(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
                       for t in kept}
    assert saved["fused"] == {(h.untyped_storage().data_ptr(), h.untyped_storage().nbytes())}
    assert len(saved["plain"]) == 2  # h (gate and up are views of it) and silu(gate)


def tiny_model_config(**kw) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=72, vocab_size=100, seq_length=16)
    return ModelConfig(**{**values, **kw})


def loss_and_grads(cfg: ModelConfig, recompute: str = "none", compile_backend: str | None = None):
    model = GPT(cfg, seed=7)
    model.set_recompute(recompute)
    if compile_backend:
        torch._dynamo.reset()
        for block in model.layers.values():
            block.compile(backend=compile_backend, fullgraph=True)  # fullgraph: no graph break
    ids = torch.randint(0, cfg.vocab_size, (2, cfg.seq_length + 1),
                        generator=torch.Generator().manual_seed(0))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("recompute", ["none", "selective"])
def test_model_same_loss_and_gradients(recompute):
    loss_ref, grads_ref = loss_and_grads(tiny_model_config(), recompute)
    model = GPT(tiny_model_config(fused_swiglu=True))
    assert all(b.mlp.fused_swiglu for b in model.layers.values())
    loss, grads = loss_and_grads(tiny_model_config(fused_swiglu=True), recompute)
    assert torch.equal(loss, loss_ref)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_selective_recompute_skips_the_fused_activation(monkeypatch):
    """The fused SwiGLU keeps only h, as recomputing it would: selective recomputation then
    recomputes the attention cores only (one checkpoint per layer, not two)."""
    import trireme.ops.recompute as recompute_module

    counts = {}
    original = recompute_module.checkpoint
    for fused in (False, True):
        calls = []

        def counting(fn, *args, calls=calls, **kwargs):
            calls.append(fn)
            return original(fn, *args, **kwargs)

        monkeypatch.setattr(recompute_module, "checkpoint", counting)
        loss_and_grads(tiny_model_config(fused_swiglu=fused), "selective")
        counts[fused] = len(calls)
    assert counts == {False: 4, True: 2}


def test_model_compiled_block_calls_the_op(monkeypatch):
    """A block compiled with fullgraph=True (aot_eager: dynamo capture and AOT autograd's
    partition, no code generation) traces through the Function and calls the custom op."""
    loss_ref, grads_ref = loss_and_grads(tiny_model_config())
    calls = []

    def counting(h, dy):
        calls.append(tuple(h.shape))
        return swiglu_backward_reference(h, dy)

    monkeypatch.setattr(swiglu_module, "swiglu_backward_reference", counting)  # the CPU op's
    loss, grads = loss_and_grads(tiny_model_config(fused_swiglu=True), "selective",
                                 compile_backend="aot_eager")
    assert calls == [(2, 16, 2 * 72)] * 2  # one per layer, in the backward
    torch.testing.assert_close(loss, loss_ref)
    for name, g in grads_ref.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-6, msg=name)


def test_gelu_ignores_the_switch():
    model = GPT(tiny_model_config(activation="gelu", fused_swiglu=True))
    assert not any(b.mlp.fused_swiglu for b in model.layers.values())


INTERPRETED = textwrap.dedent("""
    import torch
    from trireme.ops.swiglu import swiglu_backward_reference
    from trireme.ops.swiglu_triton import swiglu_backward

    torch.manual_seed(0)
    cases = [  # (leading shape, F, dtype, block_cols, block_rows): ragged column and row tiles
        ((37,), 72, torch.float32, 32, 8),
        ((3, 11), 72, torch.bfloat16, 64, 4),
        ((5,), 8, torch.float32, None, None),  # the default tile: 8 columns x 512 rows
    ]
    for shape, ffn, dtype, block_cols, block_rows in cases:
        h = (2 * torch.randn(*shape, 2 * ffn)).to(dtype)
        dy = torch.randn(*shape, ffn).to(dtype)
        dh = swiglu_backward(h, dy, block_cols=block_cols, block_rows=block_rows)
        ref = swiglu_backward_reference(h, dy)
        assert dh.shape == h.shape and dh.dtype == dtype, (dh.shape, dh.dtype)
        tol = 1e-6 if dtype == torch.float32 else 2**-7  # bf16: one ulp (fp32 sigmoids differ)
        torch.testing.assert_close(dh.float(), ref.float(), rtol=tol, atol=tol)
        # h and dy as non-contiguous views (the launcher copies them)
        wide = torch.cat([h, h], dim=-1)[..., ::2]
        assert not wide.is_contiguous()
        dh2 = swiglu_backward(wide, dy, block_cols=block_cols, block_rows=block_rows)
        torch.testing.assert_close(dh2.float(), swiglu_backward_reference(wide, dy).float(),
                                   rtol=tol, atol=tol)
    print("ok", len(cases))
""")


def test_triton_kernel_in_interpreter():
    """The Triton kernel itself, on CPU tensors through Triton's interpreter; in a subprocess,
    since TRITON_INTERPRET must be set before triton is imported."""
    pytest.importorskip("triton", reason="the SwiGLU kernel needs Triton (pip install triton)")
    assert run_in_interpreter(INTERPRETED) == "ok 3"
