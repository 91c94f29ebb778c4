"""The split-K linear kernel for few rows (trireme.ops.skinny_gemm_triton) against its torch
reference and F.linear, through Triton's CPU interpreter; the dispatcher's plan; the custom op
under torch.compile; the fused SwiGLU variant; and the module swap the serving engine makes."""

import textwrap

import pytest
import torch
import torch.nn.functional as F
from interpreted import BF16_DOT, compile_for_sm90, run_in_interpreter
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend

import trireme.ops.skinny_gemm as skinny
from trireme.config import ModelConfig
from trireme.models.mlp import MLP
from trireme.ops.skinny_gemm import (
    MAX_WEIGHT,
    SkinnyLinear,
    default_splits,
    glu_usable,
    plan,
    skinny_linear,
    skinny_mm_reference,
    skinny_swiglu_linear,
    skinny_swiglu_reference,
    usable,
    use_skinny_linears,
)
from trireme.parallel.context import ParallelContext

KERNEL_SCRIPT = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from trireme.ops.skinny_gemm_triton import skinny_mm
    from trireme.ops.skinny_gemm import skinny_mm_reference, skinny_swiglu_reference

    torch.manual_seed(0)
    checked = 0
    # (M, N, K, splits, block_n, block_k, block_m): ragged row tiles, one and several splits
    for m, n, k, splits, bn, bk, bm in [(1, 32, 64, 1, 16, 32, 16), (5, 64, 128, 2, 32, 32, 16),
                                        (19, 32, 256, 4, 16, 32, 16), (40, 48, 96, 3, 16, 16, 32)]:
        for swap in (False, True):
            for dtype in (torch.float32, torch.bfloat16):
                wide = torch.randn(m, k + 8).to(dtype)
                x = wide[:, 4 : 4 + k]  # rows at a stride of their own
                w = (torch.randn(n, k) * 0.1).to(dtype)
                got = skinny_mm(x, w, splits, bn, bk, bm, swap, num_warps=4, num_stages=2)
                want = skinny_mm_reference(x, w, splits)
                assert got.shape == (splits, m, n) and got.dtype == want.dtype, (got.shape, m)
                tol = 1e-4 if got.dtype == torch.float32 else 1e-2
                assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), (
                    m, n, k, splits, swap, dtype, (got.float() - want.float()).abs().max())
                y = got.sum(0)
                exact = F.linear(x.double(), w.double())
                assert (y.double() - exact).abs().max() < 5e-2, (m, splits)
                checked += 1
    # GLU: silu(x W_gate^T) * (x W_up^T) from one kernel, against the fp32 reference
    for m, f, k, bn, bk, bm in [(3, 32, 64, 16, 32, 16), (21, 48, 96, 16, 32, 32)]:
        for swap in (False, True):
            x = torch.randn(m, k).to(torch.bfloat16)
            w = (torch.randn(2 * f, k) * 0.2).to(torch.bfloat16)
            got = skinny_mm(x, w, 1, bn, bk, bm, swap, num_warps=4, num_stages=2, glu=True)
            want = skinny_swiglu_reference(x, w)
            assert got.shape == (1, m, f) and got.dtype == torch.bfloat16, got.shape
            assert torch.allclose(got[0].float(), want.float(), rtol=1e-2, atol=1e-2), (
                m, f, swap, (got[0].float() - want.float()).abs().max())
            checked += 1
    print(checked)
""")


def test_kernel_matches_the_reference_in_interpreter():
    pytest.importorskip("triton", reason="the kernel needs Triton")
    assert run_in_interpreter(BF16_DOT + KERNEL_SCRIPT) == "20"


def planned_launches():
    """(constexprs, num_warps, num_stages) of every launch the plans make: each TILES and
    GLU_TILES entry at both row counts (and the default tile), both operand orders, and the
    planned order with PDL and the weight prefetch."""
    launches = []
    for (n, k, _), pair in skinny.TILES.items():
        launches += [((n, k, False), pair)]
    launches += [((2 * n, k, True), pair) for (n, k), pair in skinny.GLU_TILES.items()]
    launches += [((2048, 8192, False), (skinny.Tile(),) * 2)]
    for (_, k, glu), pair in launches:
        for tile, block_m in (skinny._by_rows(pair, 1), skinny._by_rows(pair, 64)):
            for swap, prefetch in ((False, False), (True, False), (tile.swap, True)):
                yield (dict(BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
                            SWAP=swap, K=k, GLU=glu, PDL=prefetch, PREFETCH=prefetch),
                       tile.num_warps, tile.num_stages)


def test_every_planned_tile_compiles_for_sm90():
    """The interpreter runs Python, not Triton's compiler: a tile that runs there may not compile
    (once SWAP with 16 rows failed on the H200, and with it the engine's start)."""
    pytest.importorskip("triton", reason="the kernel needs Triton")
    from trireme.ops.skinny_gemm_triton import _skinny_kernel

    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*fp32"}
    compiled = 0
    for consts, warps, stages in planned_launches():
        kernel = compile_for_sm90(_skinny_kernel, consts, pointers, warps, stages)
        assert "mma" in kernel.asm["ptx"], consts  # the products on the tensor cores
        compiled += 1
    assert compiled >= 8


def test_reference_sums_equal_linear():
    torch.manual_seed(0)
    x, w = torch.randn(7, 64, dtype=torch.float64), torch.randn(24, 64, dtype=torch.float64)
    for splits in (1, 2, 4):
        part = skinny_mm_reference(x.float(), w.float(), splits)
        assert part.shape == (splits, 7, 24)
        torch.testing.assert_close(part.sum(0).double(), x @ w.t(), rtol=1e-5, atol=1e-5)
    assert skinny_mm_reference(x.bfloat16(), w.bfloat16(), 1).dtype == torch.bfloat16


def test_plan_splits_and_limits():
    assert default_splits(2048, 2048) == 8  # 32 column tiles x 8 = 256 programs
    assert default_splits(16384, 2048) == 1  # 256 column tiles already
    assert default_splits(64, 256) == 2  # at most as many splits as K has 128-wide tiles
    assert plan(2048, 8192) == 4  # llama3-1b's down projection, measured
    assert plan(2048, 2048) == 4  # llama3-1b's out projection, measured
    assert plan(3072, 2048) is None  # its qkv: not deep, not measured to gain
    assert plan(1024, 4096) == default_splits(1024, 4096) == 16  # deep, not measured
    assert plan(1030, 8192) is None  # N does not tile
    assert 128256 * 2048 > MAX_WEIGHT and plan(128256, 2048) is None  # the output layer
    x = torch.randn(4, 2048)
    assert usable(x, torch.randn(2048, 2048)) is None  # CPU and fp32: F.linear


def test_plan_traces_under_compile_without_warnings(monkeypatch):
    """The compiled decode step traces plan (and its reading of SPLITS)."""
    import warnings

    monkeypatch.setitem(skinny.SPLITS, (3072, 2048), 2)
    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(lambda x: x * plan(3072, 2048) + plan(2048, 2048),
                            fullgraph=True)(torch.ones(2))
    assert got.tolist() == [6.0, 6.0]
    assert not [w for w in caught if "skinny_gemm" in str(w.message)], caught


def test_splits_names_plans(monkeypatch):
    """A shape in SPLITS takes its split count (even one not deep enough for a default plan),
    if that count tiles K."""
    monkeypatch.setitem(skinny.SPLITS, (2048, 2048), 2)
    monkeypatch.setitem(skinny.SPLITS, (3072, 2048), 1)
    assert plan(2048, 2048) == 2 and plan(3072, 2048) == 1 and plan(2048, 8192) == 4
    monkeypatch.setitem(skinny.SPLITS, (2048, 2048), 3)  # K = 2048: not 3 x 128 x k
    assert plan(2048, 2048) is None


def test_skinny_linears_launch_as_the_engine_says(monkeypatch):
    """use_skinny_linears hands its KernelSettings to every SkinnyLinear (also to those an
    earlier call turned), whose ops get its PDL and early-reads switches; turned back, the
    layers forget them."""
    from trireme.ops.kernel_settings import KernelSettings

    seen = []

    def op(rows, weight, splits, pdl=True, early_reads=True):
        seen.append((pdl, early_reads))
        return skinny_mm_reference(rows, weight, splits)

    monkeypatch.setattr(skinny, "skinny_mm", op)
    monkeypatch.setattr(skinny, "usable", lambda x, w: 2)  # the kernel path, on the CPU
    model = nn.Sequential(nn.Linear(256, 64))
    x = torch.randn(3, 256)
    use_skinny_linears(model, kernels=KernelSettings(pdl=False))
    model(x)
    use_skinny_linears(model, kernels=KernelSettings(early_reads=False))  # already turned
    model(x)
    assert seen == [(False, True), (True, False)]
    use_skinny_linears(model, on=False)
    assert "kernels" not in vars(model[0])
    use_skinny_linears(model)
    model(x)
    assert seen[-1] == (True, True)  # the shipped settings


@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_equals_linear(bias):
    torch.manual_seed(1)
    x = torch.randn(2, 3, 256)
    w, b = torch.randn(64, 256) * 0.05, torch.randn(64)
    want = F.linear(x, w, b if bias else None)
    got = skinny_linear(x, w, b if bias else None, splits=4)  # the op's reference here
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert skinny_linear(x, w).shape == want.shape  # not usable on the CPU: F.linear


def test_custom_op_traces_under_compile():
    torch.manual_seed(2)
    x, w = torch.randn(5, 128), torch.randn(96, 128)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda a, b: skinny_linear(a, b, splits=2) * 2, backend=counter,
                             fullgraph=True, dynamic=True)
    torch.testing.assert_close(compiled(x, w), F.linear(x, w) * 2, rtol=1e-5, atol=1e-5)
    x9 = torch.randn(9, 128)  # another row count: the same graph (no shape in the op's args)
    torch.testing.assert_close(compiled(x9, w), F.linear(x9, w) * 2, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


def test_use_skinny_linears_keeps_parameters_and_outputs():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 8, bias=False)))
    params = dict(model.named_parameters())
    keys = list(model.state_dict())
    x = torch.randn(4, 16)
    want = model(x)
    first = model[0]
    assert use_skinny_linears(model) == 2
    assert isinstance(model[0], SkinnyLinear) and isinstance(model[2][0], SkinnyLinear)
    assert model[0] is first  # the same module object, its class changed
    assert list(model.state_dict()) == keys
    assert all(p is params[name] for name, p in model.named_parameters())
    torch.testing.assert_close(model(x), want)
    assert use_skinny_linears(model) == 0  # already swapped
    assert use_skinny_linears(model, on=False) == 2
    assert type(model[0]) is nn.Linear and type(model[2][0]) is nn.Linear
    assert all(p is params[name] for name, p in model.named_parameters())


def test_swiglu_reference_and_the_fused_op_equal_linear_then_silu():
    torch.manual_seed(4)
    x, w = torch.randn(2, 5, 64), torch.randn(96, 64) * 0.1
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    want = F.silu(gate) * up
    torch.testing.assert_close(skinny_swiglu_reference(x.reshape(-1, 64), w).view(2, 5, 48), want,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny_swiglu_linear(x, w, fused=True), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(skinny_swiglu_linear(x, w), want)  # not usable here: unfused
    assert not glu_usable(x, w)
    compiled = torch.compile(lambda a, b: skinny_swiglu_linear(a, b, fused=True), fullgraph=True,
                             backend="aot_eager", dynamic=True)
    torch.testing.assert_close(compiled(x, w), want, rtol=1e-5, atol=1e-5)


def test_mlp_takes_the_fused_swiglu_when_its_layers_are_swapped(monkeypatch):
    cfg = ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                      vocab_size=64, seq_length=16, activation="swiglu")
    mlp = MLP(cfg, ParallelContext()).eval()
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(1, 3, 32)
    with torch.no_grad():
        want = mlp(x)
        assert use_skinny_linears(mlp) == 2
        calls = []
        monkeypatch.setattr(skinny, "glu_usable", lambda a, b: calls.append(b.shape) or True)
        got = mlp(x)
    assert calls == [(96, 32)]  # fc1 [gate; up] through the fused op (its reference here)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    mlp(x)  # with autograd on: the plain path (the kernels have no backward)
    assert calls == [(96, 32)]


def test_the_row_guard_splits_dynamic_graphs_at_max_rows(monkeypatch):
    """Under torch.compile with the rows dynamic, the kernel path guards on rows <= MAX_ROWS:
    one graph above, one at or below (why compiled_prefill warms up a short prompt too)."""
    monkeypatch.setattr(skinny, "_small_inference_input",
                        lambda x, w: 0 < x.numel() // x.shape[-1] <= skinny.MAX_ROWS)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda a, b: skinny_linear(a, b), backend=counter, dynamic=True)
    w = torch.randn(256, 1024) * 0.05  # deep (K = 4 N): a plan
    with torch.no_grad():
        for rows in (300, 150, 10, 40, 64, 65, 1000):
            x = torch.randn(rows, 1024)
            torch.testing.assert_close(compiled(x, w), F.linear(x, w), rtol=1e-4, atol=1e-4)
    assert counter.frame_count == 2


def test_unavailable_off_cuda():
    assert skinny.unavailable(torch.device("cpu")) == "not a CUDA device"
