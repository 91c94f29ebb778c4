"""The fused cross-entropy's Triton softmax kernel (trireme.ops.cross_entropy_triton) against the
eager reference `_loss_and_grad`, and its e5m2 output (the fp8 output layer's) against
`_loss_and_grad_e5m2`, through Triton's CPU interpreter; and the choice between it and the
compiled path (model.fused_cross_entropy_kernel), for the bf16 and the fp8 output layer."""

import textwrap

import pytest
import torch
from interpreted import BF16_ROUND, E5M2_ROUND, run_in_interpreter, run_sm90_script

from trireme.config import load_config
from trireme.errors import ConfigError, TriremeError
from trireme.ops.fused_cross_entropy import (
    _compiled_loss_and_grad_e5m2,
    _loss_and_grad,
    _loss_and_grad_e5m2,
    _loss_and_grad_then_e5m2,
    chunk_step,
    fp8_chunk_step,
    fused_linear_cross_entropy,
)
from trireme.plan.activations import head_bytes, shape_of

# the kernel tests' logits (with padding columns), labels (one ignored) and token weights
CASES = textwrap.dedent("""
    import torch

    def random_case(seed, c, n_cols, vocab):
        gen = torch.Generator().manual_seed(seed)
        z = torch.randn(c, n_cols, generator=gen) * 3
        z[:, vocab:] = float("nan")  # padding: never read (the reference sets it to -inf)
        y = torch.randint(0, vocab, (c,), generator=gen)
        y[1] = -100  # ignored
        w = torch.rand(c, generator=gen)  # a loss mask of fractional weights
        w[1], w[2], w[3] = 0.0, 0.0, 2.5  # the ignored label, a masked token, a weight > 1
        return z, y, w

    def extreme_case(n_cols, vocab):
        rows = [torch.zeros(vocab) for _ in range(7)]
        rows[0][-1] = 1e4  # the max in the last tile: every earlier sum rescaled to 0
        rows[1][0], rows[1][1:] = 80.0, -80.0  # the max first, tiny terms after
        rows[2] = torch.linspace(-50.0, 50.0, vocab)  # a new max in every tile
        rows[3][:20] = float("-inf")  # a first tile of -inf logits (masked tokens)
        rows[3][20:] = torch.linspace(-3.0, 3.0, vocab - 20)
        rows[4] += 1e3  # all equal and large
        rows[5] = torch.linspace(-3e4, 3e4, vocab).flip(0)  # large magnitudes, both signs
        rows[6] = -rows[5]
        z = torch.full((7, n_cols), float("inf"))  # +inf padding: still probability 0
        z[:, :vocab] = torch.stack(rows)
        y = torch.tensor([vocab - 1, 5, 0, 25, 3, vocab - 1, 0])
        return z, y, torch.tensor([1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.25])

    # (c, padded columns, vocab_size, block): tiles with a ragged last one, padding that spans
    # a whole tile, no padding, one tile (the default block)
    shapes = [(7, 48, 45, 16), (6, 64, 37, 16), (5, 40, 40, 16), (9, 100, 97, None)]
    cases = [(f"random {s}", *random_case(i, *s[:3]), s[2], s[3]) for i, s in enumerate(shapes)]
    cases += [("extreme", *extreme_case(70, 64), 64, 16), ("extreme 1 tile", *extreme_case(70, 64),
              64, None)]
""")

KERNEL_SCRIPT = BF16_ROUND + CASES + textwrap.dedent("""
    import math
    import torch
    from trireme.ops.cross_entropy_triton import loss_and_grad
    from trireme.ops.fused_cross_entropy import _loss_and_grad

    # the unit roundoff (half an ulp, relative) of each dtype
    ROUNDOFF = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
    for name, z32, y, w, vocab, block in cases:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            if dtype == torch.float16 and "extreme" in name:
                continue  # 1e4 and 3e4 do not fit fp16 exactly (6.5e4 is its max)
            z = z32.to(dtype)
            where = f"{name} {dtype}"
            loss, d = loss_and_grad(z, y, w, vocab, block=block)
            loss_tile, d_tile = loss_and_grad(z, y, w, vocab, block=32, num_warps=1)
            # the reference on the same values upcast: the exact math, before any rounding
            ref_loss, ref32 = _loss_and_grad(z.float().clone(), y, w, vocab)  # overwritten
            _, ref = _loss_and_grad(z.clone(), y, w, vocab)  # as the fused path calls it
            assert d.dtype == dtype and d.shape == z.shape, where
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5, msg=where)
            # the kernel's fp32 gradient rounded once: within half an ulp of the exact one
            # (plus the fp32 noise of a different summation order)
            err = (d.float() - ref32).abs()
            bound = (ROUNDOFF[dtype] + 2e-6) * ref32.abs() + 1e-7
            assert (err <= bound).all(), (where, (err - bound).max().item())
            torch.testing.assert_close(d.float(), ref.float(), rtol=2 * ROUNDOFF[dtype], atol=1e-7,
                                       msg=where)  # at most an ulp from the reference's cast
            assert (d[:, vocab:] == 0).all(), where  # padding: exactly 0 (nan / inf there)
            assert (d[w == 0] == 0).all(), where  # ignored and masked rows: exactly 0
            assert torch.isfinite(loss) and d[w > 0].abs().sum() > 0, where
            # another tile: the same up to fp32 summation order
            torch.testing.assert_close(loss_tile, loss, rtol=1e-6, atol=1e-5, msg=where)
            assert ((d_tile.float() - ref32).abs() <= bound).all(), where
            assert (d_tile[:, vocab:] == 0).all() and (d_tile[w == 0] == 0).all(), where
            # in place over strided rows (a wider buffer): the same numbers, no new tensor
            wide = torch.zeros(z.shape[0], z.shape[1] + 5, dtype=dtype)
            wide[:, : z.shape[1]] = z
            view = wide[:, : z.shape[1]]
            loss2, d2 = loss_and_grad(view, y, w, vocab, in_place=True, block=block)
            assert d2.data_ptr() == view.data_ptr() and torch.equal(d2, d), where
            assert torch.equal(loss2, loss) and (wide[:, z.shape[1]:] == 0).all(), where
    print("ok")
""")


def test_kernel_matches_the_eager_reference_in_interpreter():
    pytest.importorskip("triton", reason="the cross-entropy kernel needs Triton")
    assert run_in_interpreter(KERNEL_SCRIPT).splitlines()[-1] == "ok"


# the fp8 output layer's e5m2 gradient: the kernel with out_scale against the eager reference
# `_loss_and_grad_e5m2` (the compiled path's function, run eagerly) on the same logits
FP8_SCRIPT = E5M2_ROUND + BF16_ROUND + CASES + textwrap.dedent("""
    import torch
    from trireme.ops.cross_entropy_triton import loss_and_grad
    from trireme.ops.fp8 import E5M2, quantize, scale_from_amax
    from trireme.ops.fused_cross_entropy import _loss_and_grad_e5m2

    def ordinal(q):  # e5m2 codes in value order: neighbours differ by 1 (+0 and -0 both 0)
        bits = q.view(torch.uint8).int()
        return torch.where(bits >= 128, -(bits - 128), bits)

    # and a larger one, for a count of the rare differences: 48 x 4000 random logits
    cases.append(("large", *random_case(9, 48, 4096, 4000), 4000, 1024))
    differ, total = 0, 0
    for name, z32, y, w, vocab, block in cases:
        s0 = scale_from_amax(w.abs().max(), E5M2)  # the fp8 head's a-priori scale
        # and one 8x larger, so that |dz * s| past e5m2 max saturates; the large case: the
        # head's bf16 logits and scale only
        runs = [(d, s) for d in (torch.float32, torch.bfloat16) for s in (s0, s0 * 8)]
        for dtype, s in [(torch.bfloat16, s0)] if name == "large" else runs:
            z = z32.to(dtype)
            where = f"{name} {dtype} scale {s.item()}"
            loss, q = loss_and_grad(z, y, w, vocab, out_scale=s, block=block)
            assert q.dtype == E5M2 and q.shape == z.shape and q.is_contiguous(), where
            # the reference: the real columns alone (the fp8 head's logits have no padding)
            ref_loss, ref = _loss_and_grad_e5m2(z[:, :vocab].clone(), y, w, s)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-5, msg=where)
            steps = (ordinal(q[:, :vocab]) - ordinal(ref)).abs()
            assert steps.max() <= 1, (where, steps.max().item())  # one e5m2 step at most
            differ, total = differ + int((steps > 0).sum()), total + steps.numel()
            assert (q[:, vocab:].float() == 0).all(), where  # padding: exactly 0
            assert (q[w == 0].float() == 0).all(), where  # ignored and masked rows
            assert q[w > 0].float().abs().sum() > 0, where
            # the rounding itself, bit for bit: the e5m2 output is torch's quantize of the
            # kernel's own fp32 gradient (the same fp32 math on the upcast logits)
            loss32, d32 = loss_and_grad(z.float(), y, w, vocab, block=block)
            assert torch.equal(q.view(torch.uint8),
                               quantize(d32, E5M2, s)[0].view(torch.uint8)), where
            assert torch.equal(loss32, loss), where
    try:
        loss_and_grad(z, y, w, vocab, out_scale=s, in_place=True)
        raise AssertionError("in place with an e5m2 output")
    except ValueError as e:
        assert "in_place with out_scale" in str(e)
    print(f"differ {differ} of {total}")
    assert differ <= total * 1e-3, (differ, total)
    print("ok")
""")


def test_kernel_e5m2_output_matches_the_reference_in_interpreter():
    """The e5m2 gradient equals `_loss_and_grad_e5m2`'s up to one e5m2 step where the fp32
    softmax (another summation order and exp) lands on the other side of a rounding boundary:
    0 of 202,024 elements here (the count is printed), allowed up to 0.1%."""
    pytest.importorskip("triton", reason="the cross-entropy kernel needs Triton")
    out = run_in_interpreter(FP8_SCRIPT)
    print(out)
    assert out.splitlines()[-1] == "ok"


# the whole chunked loss with the kernel (its device check let through to the CPU, where the
# interpreter runs it): a GPT's loss and gradients, and bf16 operands, against the torch path
WIRING_SCRIPT = BF16_ROUND + textwrap.dedent("""
    import dataclasses, sys
    import torch
    import trireme.ops.cross_entropy_triton as cet
    import trireme.ops.fused_cross_entropy as fce
    from trireme.config import ModelConfig
    from trireme.models.gpt import GPT

    calls = []
    plain_launch = cet.loss_and_grad
    def counted(*args, **kwargs):
        calls.append(kwargs.get("in_place"))
        return plain_launch(*args, **kwargs)
    cet.loss_and_grad = counted
    fce._triton_runs_on = lambda device: True

    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                      ffn_hidden_size=48, vocab_size=100, seq_length=16, tie_embeddings=True,
                      fused_cross_entropy="true", loss_chunk_size=7)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 100, (2, 17), generator=gen)
    tokens, labels = ids[:, :-1], ids[:, 1:].clone()
    labels[0, :4] = -100
    mask = torch.ones(2, 16)
    mask[1, 10:] = 0.5
    results = {}
    for kernel in ("compiled", "triton"):
        model = GPT(dataclasses.replace(cfg, fused_cross_entropy_kernel=kernel), seed=5)
        loss = model(tokens, labels, loss_mask=mask)
        loss.backward()
        results[kernel] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    assert calls == [True] * 5, calls  # 32 tokens in chunks of 7, written in place
    (loss_c, g_c), (loss_t, g_t) = results["compiled"], results["triton"]
    torch.testing.assert_close(loss_t, loss_c, rtol=1e-6, atol=1e-6)
    for name in g_c:
        torch.testing.assert_close(g_t[name], g_c[name], rtol=1e-5, atol=1e-6, msg=name)
    assert g_t["embedding.weight"][100:].abs().sum() == 0  # the padded rows

    x = torch.randn(20, 32, generator=gen).bfloat16()
    w = (torch.randn(128, 32, generator=gen) * 0.5).bfloat16()
    y = torch.randint(0, 100, (20,), generator=gen)
    out = {}
    for kernel in ("compiled", "triton"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fce.fused_linear_cross_entropy(xs, ws, y, vocab_size=100, chunk_size=8,
                                              softmax_kernel=kernel)
        loss.backward()
        out[kernel] = (loss.detach(), xs.grad.float(), ws.grad.float())
    for a, b in zip(out["triton"], out["compiled"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)
    assert out["triton"][2][100:].abs().sum() == 0
    print("ok")
""")


def test_chunked_loss_through_the_kernel_in_interpreter():
    pytest.importorskip("triton", reason="the cross-entropy kernel needs Triton")
    assert run_in_interpreter(WIRING_SCRIPT).splitlines()[-1] == "ok"


# the fp8 output layer's chunks through the kernel (its device check let through to the CPU, the
# fp8 matmuls emulated): every chunk takes it with "triton", and the e5m2 gradients, the loss and
# the input gradients match the torch path's ("compiled" without compile: the eager one)
FP8_WIRING_SCRIPT = E5M2_ROUND + textwrap.dedent("""
    import torch
    import trireme.ops.cross_entropy_triton as cet
    import trireme.ops.fused_cross_entropy as fce

    grads = {"compiled": [], "triton": []}  # each chunk's q5(dlogits), per path
    plain_launch, plain_eager = cet.loss_and_grad, fce._loss_and_grad_then_e5m2
    def kernel(*args, **kwargs):
        assert kwargs["out_scale"].dim() == 0 and not kwargs.get("in_place"), kwargs
        loss, q = plain_launch(*args, **kwargs)
        grads["triton"].append(q)
        return loss, q
    def eager(*args):
        loss, q = plain_eager(*args)
        grads["compiled"].append(q)
        return loss, q
    cet.loss_and_grad, fce._loss_and_grad_then_e5m2 = kernel, eager
    fce._triton_runs_on = lambda device: True

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(40, 32, generator=gen)
    w = torch.randn(112, 32, generator=gen) * 0.5
    y = torch.randint(0, 100, (40,), generator=gen)
    y[:3] = -100
    mask = torch.ones(40)
    mask[30:] = 0.5
    out = {}
    for k in ("compiled", "triton"):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fce.fused_linear_cross_entropy(xs, ws, y, mask, vocab_size=100, chunk_size=16,
                                              fp8="emulate", softmax_kernel=k)
        loss.backward()
        out[k] = (loss.detach(), xs.grad, ws.grad)
    assert [q.shape for q in grads["triton"]] == [(16, 100), (16, 100), (8, 100)]
    assert len(grads["compiled"]) == 3
    for q_t, q_c in zip(grads["triton"], grads["compiled"]):
        assert q_t.dtype == q_c.dtype == torch.float8_e5m2
        # the same values (the eager path writes an ignored label's zero row as -0.0)
        assert torch.equal(q_t.float(), q_c.float())
    (loss_c, gx_c, gw_c), (loss_t, gx_t, gw_t) = out["compiled"], out["triton"]
    torch.testing.assert_close(loss_t, loss_c, rtol=1e-6, atol=1e-6)
    assert torch.equal(gx_t, gx_c) and torch.equal(gw_t, gw_c)  # the same q5(g), the same matmuls
    assert gw_t[100:].abs().sum() == 0 and gx_t.abs().sum() > 0
    print("ok")
""")


def test_fp8_chunks_through_the_kernel_in_interpreter():
    pytest.importorskip("triton", reason="the cross-entropy kernel needs Triton")
    assert run_in_interpreter(FP8_WIRING_SCRIPT).splitlines()[-1] == "ok"


# compiled for an H100 / H200 (sm_90) without a GPU: the GPU lowering accepts the kernel (the
# interpreter is laxer about types), rounds fp32 -> bf16 to nearest even (what BF16_ROUND makes
# the interpreter do), fp32 -> e5m2 the same way with saturation (cvt.rn.satfinite: what
# E5M2_ROUND makes the interpreter do) and keeps the tile in registers (no stack or local
# memory: no spills)
SM90_SCRIPT = textwrap.dedent("""
    import os, subprocess, triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from trireme.ops.cross_entropy_triton import BLOCK, NUM_WARPS, _cross_entropy_kernel

    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    # (logits, gradient out, FP8_MAX): the bf16 and fp32 heads, and the fp8 head's e5m2 output
    for dtype, out, fp8_max in (("bf16", "bf16", 0.0), ("fp32", "fp32", 0.0),
                                ("bf16", "fp8e5", 57344.0)):
        signature = {"logits_ptr": f"*{dtype}", "out_ptr": f"*{out}", "labels_ptr": "*i64",
                     "weight_ptr": "*fp32", "loss_ptr": "*fp32", "scale_ptr": "*fp32",
                     "logits_stride": "i32", "out_stride": "i32", "n_cols": "i32",
                     "vocab_size": "i32", "BLOCK": "constexpr", "EVICT_1": "constexpr",
                     "EVICT_2": "constexpr", "FP8_MAX": "constexpr"}
        # what Triton's launcher assumes for gpt2's [c, 50304] logits: 16-byte aligned
        # pointers, strides and column count multiples of 16 (the vocabulary 50257 is not)
        aligned = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(signature)
                   if n.endswith(("_ptr", "_stride")) or n == "n_cols"}
        source = ASTSource(fn=_cross_entropy_kernel, signature=signature, attrs=aligned,
                           constexprs={"BLOCK": BLOCK, "EVICT_1": "evict_last",
                                       "EVICT_2": "evict_first", "FP8_MAX": fp8_max})
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                                options={"num_warps": NUM_WARPS})
        ptx = kernel.asm["ptx"]
        assert ("cvt.rn.bf16" in ptx) == (out == "bf16"), out
        # two values a conversion, 16 a thread a tile: round to nearest even, saturated
        assert ptx.count("cvt.rn.satfinite.e5m2x2.f32") == (8 if out == "fp8e5" else 0), out
        assert "ex2.approx" in ptx
        assert "evict_last" in ptx and "evict_first" in ptx  # the L2 hints
        # the logits move as 16-byte vectors in both passes (a load masked by the odd vocabulary
        # would be 16 scalar ones a thread): the only narrow loads are the target logit's, the
        # label's, the weight's (and the scale's)
        loads = [line for line in ptx.splitlines() if "ld.global" in line]
        stores = [line for line in ptx.splitlines() if "st.global" in line]
        assert sum(".v4." in line for line in loads) >= 4, loads
        # the gradient's 16 values a thread a tile: 16-byte stores (one for e5m2)
        wide = {"bf16": 2, "fp32": 4, "fp8e5": 1}[out]
        assert sum(".v4." in line for line in stores) >= wide, stores
        assert sum(".v4." not in line for line in loads) <= 3 + (fp8_max > 0), loads
        with open("k.cubin", "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = subprocess.run([tool, "--dump-resource-usage", "k.cubin"], capture_output=True,
                               text=True, check=True).stdout
        print(dtype, out, usage.split("REG")[1].split("CONSTANT")[0].strip())
        assert "STACK:0 " in usage and "LOCAL:0 " in usage, usage  # no spills
    print("ok")
""")


def test_kernel_compiles_for_sm90(tmp_path):
    out = run_sm90_script(SM90_SCRIPT, tmp_path)
    print(out)


def test_triton_choice_runs_the_torch_path_off_cuda():
    cpu = torch.device("cpu")
    assert chunk_step("triton", False, cpu) is _loss_and_grad
    assert chunk_step("compiled", False, cpu) is _loss_and_grad
    with pytest.raises(TriremeError, match="softmax_kernel = 'fast'"):
        chunk_step("fast", False, cpu)
    # the fp8 output layer's chunks: the torch path too, compiled (the reference) or eager
    assert fp8_chunk_step("triton", False, cpu) is _loss_and_grad_then_e5m2
    assert fp8_chunk_step("triton", True, cpu) is _compiled_loss_and_grad_e5m2()
    assert fp8_chunk_step("compiled", True, cpu) is _compiled_loss_and_grad_e5m2()
    with pytest.raises(TriremeError, match="softmax_kernel = 'fast'"):
        fp8_chunk_step("fast", False, cpu)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(9, 8, generator=gen)
    w = torch.randn(16, 8, generator=gen)
    labels = torch.randint(0, 12, (9,), generator=gen)
    losses = [fused_linear_cross_entropy(x, w, labels, vocab_size=12, chunk_size=4,
                                         softmax_kernel=k) for k in ("compiled", "triton")]
    assert torch.equal(losses[0], losses[1]) and losses[0] > 0


def test_config_key():
    assert load_config("tiny", []).model.fused_cross_entropy_kernel == "triton"
    cfg = load_config("tiny", ["model.fused_cross_entropy_kernel=compiled"])
    assert cfg.model.fused_cross_entropy_kernel == "compiled"
    with pytest.raises(ConfigError, match="fused_cross_entropy_kernel"):
        load_config("tiny", ["model.fused_cross_entropy_kernel=fast"])


def test_plan_counts_the_gradient_written_over_the_logits():
    """trireme plan's head peak: the Triton kernel needs the chunk's logits only (no second
    [chunk, vocab] tensor), where it runs: on a GPU, not for the fp8 output layer."""
    base = {"model.vocab_size": 1000, "model.fused_cross_entropy": "true",
            "model.precision": "bf16", "model.loss_chunk_size": 64}

    def peak(gpu, **extra):
        cfg = load_config("tiny", {**base, **extra})
        return head_bytes(cfg, shape_of(cfg, norm_fused=False, gpu=gpu), 256).peak

    triton = {"model.fused_cross_entropy_kernel": "triton"}
    compiled = {"model.fused_cross_entropy_kernel": "compiled"}
    assert peak(True, **compiled) - peak(True, **triton) == 64 * 1000 * 2  # one [chunk, vocab] less
    assert peak(True) == peak(True, **triton)  # the default
    assert peak(False, **triton) == peak(False, **compiled)  # the CPU: the torch path
    fp8 = {"model.precision": "fp8", "model.fp8_layers": ["qkv", "output"]}
    assert peak(True, **fp8, **triton) == peak(True, **fp8)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernel_on_cuda(dtype):
    """On a GPU: gpt2's padded vocabulary (50257 of 50304 columns), against the eager reference
    on the same values, and the chunked loss through it against the compiled path."""
    pytest.importorskip("triton")
    from trireme.ops.cross_entropy_triton import loss_and_grad

    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(64, 50304, generator=gen, device="cuda") * 4).to(dtype)
    y = torch.randint(0, 50257, (64,), generator=gen, device="cuda")
    y[::7] = -100
    w = (y != -100).float() * torch.rand(64, generator=gen, device="cuda")
    loss, d = loss_and_grad(z, y, w, 50257)
    ref_loss, ref32 = _loss_and_grad(z.float().clone(), y, w, 50257)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
    roundoff = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    assert ((d.float() - ref32).abs() <= (roundoff + 1e-5) * ref32.abs() + 1e-7).all()
    assert (d[:, 50257:] == 0).all() and (d[w == 0] == 0).all()

    x = torch.randn(300, 64, generator=gen, device="cuda").to(dtype)
    weight = (torch.randn(50304, 64, generator=gen, device="cuda") * 0.2).to(dtype)
    labels = torch.randint(0, 50257, (300,), generator=gen, device="cuda")
    out = {}
    for kernel in ("compiled", "triton"):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xs, ws, labels, vocab_size=50257, chunk_size=128,
                                          compile=True, softmax_kernel=kernel)
        loss.backward()
        out[kernel] = (loss.detach(), xs.grad.float(), ws.grad.float())
    tol = dict(rtol=2e-2, atol=2e-3) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-6)
    for a, b in zip(out["triton"], out["compiled"]):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on CUDA")
def test_kernel_e5m2_output_on_cuda():
    """On a GPU, llama3's vocabulary: the e5m2 gradient against the eager and the compiled
    reference (one e5m2 step at most, and rarely: the count is printed), its rounding bit for
    bit torch's (quantize of the kernel's own fp32 gradient), and the fp8 head through it
    against the compiled path."""
    pytest.importorskip("triton")
    from trireme.ops.cross_entropy_triton import loss_and_grad
    from trireme.ops.fp8 import E5M2, quantize, scale_from_amax

    gen = torch.Generator(device="cuda").manual_seed(0)
    z = (torch.randn(256, 128256, generator=gen, device="cuda") * 4).bfloat16()
    y = torch.randint(0, 128256, (256,), generator=gen, device="cuda")
    y[::9] = -100
    w = (y != -100).float() * torch.rand(256, generator=gen, device="cuda")
    s = scale_from_amax(w.abs().max(), E5M2)
    loss, q = loss_and_grad(z, y, w, out_scale=s)
    for name, ref_step in (("eager", _loss_and_grad_e5m2),
                           ("compiled", _compiled_loss_and_grad_e5m2())):
        ref_loss, ref = ref_step(z, y, w, s)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-3)
        a, b = q.view(torch.uint8).int(), ref.view(torch.uint8).int()
        steps = (torch.where(a >= 128, 128 - a, a) - torch.where(b >= 128, 128 - b, b)).abs()
        print(f"{name}: {int((steps > 0).sum())} of {steps.numel()} differ")
        assert steps.max() <= 1 and (steps > 0).sum() <= steps.numel() * 1e-4
    _, d32 = loss_and_grad(z.float(), y, w)
    assert torch.equal(q.view(torch.uint8), quantize(d32, E5M2, s)[0].view(torch.uint8))

    x = torch.randn(512, 2048, generator=gen, device="cuda").bfloat16()
    weight = (torch.randn(8192, 2048, generator=gen, device="cuda") * 0.02).bfloat16()
    labels = torch.randint(0, 8192, (512,), generator=gen, device="cuda")
    out = {}
    for kernel in ("compiled", "triton"):
        xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fused_linear_cross_entropy(xs, ws, labels, chunk_size=256, compile=True,
                                          fp8="on", softmax_kernel=kernel)
        loss.backward()
        out[kernel] = (loss.detach(), xs.grad.float(), ws.grad.float())
    torch.testing.assert_close(out["triton"][0], out["compiled"][0], rtol=1e-5, atol=1e-5)
    for a, b in zip(out["triton"][1:], out["compiled"][1:]):  # relative, Frobenius
        assert (a - b).norm() <= 1e-2 * b.norm() and b.norm() > 0
