"""The compiled decode step's fusions (trireme.serving.compiled_decode): without QK-norm the
pre-attention piece RoPEs q and k as one tensor and hands the paged kernel strided views of the
qkv projection (no copies), with QK-norm it keeps attention.heads; the block's last residual add
also computes the next layer's input norm, handed on within a step (PagedCache's Carry) and never
past it; the paged kernels (Triton, through its interpreter, and the gather path) take strided q,
k, v as they take contiguous ones; and Inductor makes fewer kernels per layer."""

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from interpreted import BF16_DOT, run_in_interpreter
from test_compiled_decode import recorded_run
from test_compiled_prefill import recorded
from test_paged_attention import paged_case
from test_serve_engine import RunningMean, config, model_of, prompts

import trireme.models.block as block_module
import trireme.serving.compiled_prefill as compiled_prefill
from trireme.models.paged import Carry, PagedStep
from trireme.ops.paged_attention import paged_decode_attention
from trireme.serving.compiled_decode import _pre, _project, compiled_layer, first_attention_norm
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

REPO = Path(__file__).resolve().parent.parent
NO_QK_NORM = dict(qk_norm=False)  # the llama3 shape: RoPE, no QK-norm, GQA


def block_inputs(model, tokens: int = 5, seed: int = 0):
    """The first block, x [1, T, h] and the ragged rope (cos, sin [1, T, d]) at random
    positions, as a decode step has them."""
    gen = torch.Generator().manual_seed(seed)
    block = next(iter(model.layers.values()))
    x = torch.randn(1, tokens, model.cfg.hidden_size, generator=gen)
    positions = torch.randint(0, model.cfg.seq_length, (1, tokens), generator=gen)
    rope = model.rope(x.device, position_ids=positions) if model.rope is not None else None
    return block, x, rope


def heads_reference(block, x, rope):
    """q [T, H, d], k, v [T, n_kv, d] the eager forward's way (attention.heads)."""
    attention = block.attention
    q, k, v = attention.heads(attention.qkv(block.attention_norm(x)), rope)
    return [t[0].transpose(0, 1) for t in (q, k, v)]


@pytest.mark.parametrize("overrides", [NO_QK_NORM, dict(qk_norm=False,
                                                        position_embedding="learned")])
@torch.no_grad()
def test_without_qk_norm_q_and_k_are_one_tensor_and_v_a_view_of_qkv(overrides, monkeypatch):
    model = model_of(config(**overrides))
    block, x, rope = block_inputs(model)
    attention = block.attention
    monkeypatch.setattr(attention, "heads", lambda *a: pytest.fail("heads() was called"))
    q, k, v = _pre(block, "attention", x, rope)
    monkeypatch.undo()
    for got, want in zip((q, k, v), heads_reference(block, x, rope)):
        torch.testing.assert_close(got, want, atol=0, rtol=0)  # the same math, elementwise
    n_heads, n_kv, d = attention.num_heads, attention.num_kv_heads, attention.head_size
    assert n_heads != n_kv  # GQA: q and k differ in heads
    # q and k: the heads of one [T, n_heads + n_kv, d] tensor (one RoPE; without RoPE qkv's
    # own columns), v: qkv's own columns
    row = (n_heads + n_kv) * d if rope is not None else (n_heads + 2 * n_kv) * d
    assert q.stride() == (row, d, 1) and k.stride() == q.stride()
    assert k.data_ptr() == q.data_ptr() + n_heads * d * q.element_size()
    assert v.stride() == ((n_heads + 2 * n_kv) * d, d, 1)  # a view of [T, (H + 2 n_kv) d]


@torch.no_grad()
def test_with_qk_norm_the_heads_path_gives_contiguous_q_k_v(monkeypatch):
    model = model_of(config(qk_norm=True))
    block, x, rope = block_inputs(model)
    calls = []
    real = block.attention.heads
    monkeypatch.setattr(block.attention, "heads", lambda *a: calls.append(1) or real(*a))
    q, k, v = _project(block, "attention", block.attention_norm(x), rope)
    assert calls == [1]
    monkeypatch.undo()
    for got, want in zip((q, k, v), heads_reference(block, x, rope)):
        assert got.is_contiguous()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def spy_layers(engine):
    """Wrap the cache's compiled layer: per call (layer's block, got a carried h, left one)."""
    calls = []
    layer = engine.cache.compiled_layer

    def spying(block, x, rope, states, step, h=None, following=None):
        x, h_next = layer(block, x, rope, states, step, h, following)
        calls.append((block, h is not None, h_next is not None))
        return x, h_next

    engine.cache.compiled_layer = spying
    return calls


def spied_compiled_run(model, monkeypatch, texts, params, **kwargs):
    """recorded_run with every engine's decode steps through compiled_layer("aot_eager") and
    its layers spied on (spy_layers): (requests, logits, one spy record per engine)."""
    calls: list = []
    real_init = Engine.__init__

    def init_and_spy(self, *args, **kw):
        real_init(self, *args, **kw)
        self.cache.compiled_layer = compiled_layer("aot_eager")
        calls.append(spy_layers(self))

    monkeypatch.setattr(Engine, "__init__", init_and_spy)
    compiled, got = recorded_run(model, None, monkeypatch, texts, params, **kwargs)
    return compiled, got, calls


@pytest.mark.parametrize("overrides", [NO_QK_NORM, dict(num_layers=3)])
@torch.no_grad()
def test_compiled_decode_hands_the_next_norm_on_and_gives_the_eager_logits(
        overrides, monkeypatch):
    """Every decode step: layer 0 computes its own input norm, each later layer gets it from
    the layer before (which computed it with its last residual add), the last hands none on;
    logits and tokens as the eager forward's (without QK-norm: through the fused RoPE)."""
    model = model_of(config(**overrides))
    texts = prompts(5, seed=4, longest=14)
    params = [SamplingParams(max_tokens=2 + i % 3, greedy=True) for i in range(len(texts))]
    eager, want = recorded_run(model, None, monkeypatch, texts, params)
    compiled, got, calls = spied_compiled_run(model, monkeypatch, texts, params)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    blocks = list(model.layers.values())
    (seen,) = calls
    assert len(seen) >= 2 * len(blocks) and len(seen) % len(blocks) == 0
    for i, (block, got_h, left_h) in enumerate(seen):
        layer = i % len(blocks)
        assert block is blocks[layer]
        assert got_h == (layer > 0) and left_h == (layer < len(blocks) - 1)


@torch.no_grad()
def test_compiled_prompt_steps_take_the_fused_rope_views(monkeypatch):
    """compile_prefill's pieces share _pre: without QK-norm its strided q, k, v views go through
    PagedKV.attend (store, causal attention over a prompt's chunks) and give the eager logits."""
    model = model_of(config(**NO_QK_NORM))
    texts = prompts(5, seed=5, longest=30)
    params = [SamplingParams(max_tokens=2 + i % 3, greedy=True) for i in range(len(texts))]
    _, eager, want, _ = recorded(model, monkeypatch, texts, params)
    _, compiled, got, steps = recorded(model, monkeypatch, texts, params, "aot_eager")
    assert steps and [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_a_recurrent_mixer_first_gets_no_norm_handed_on(monkeypatch):
    """Blocks that start with a mixer with a per-request state (eager) get no norm from the
    block before, nor does that block compute one; the attention blocks still do; the logits
    are the eager forward's (no graphs: slot states)."""
    monkeypatch.setitem(block_module.SUBLAYERS, "mamba", RunningMean)
    model = model_of(config(num_layers=3, layer_pattern="M-*-M", qk_norm=False))
    texts = prompts(4, seed=8, longest=12)
    params = [SamplingParams(max_tokens=3, greedy=True)] * len(texts)
    eager, want = recorded_run(model, None, monkeypatch, texts, params, graphs=False)
    compiled, got, calls = spied_compiled_run(model, monkeypatch, texts, params, graphs=False)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    blocks = list(model.layers.values())
    cache = Engine(model, EngineSettings(block_size=4, max_running=1)).cache
    starts = [first_attention_norm(b, cache[i]) is not None for i, b in enumerate(blocks)]
    assert starts.count(True) and starts.count(False)  # both kinds of block
    seen = calls[0]
    assert seen and len(seen) % len(blocks) == 0
    for i, (block, got_h, left_h) in enumerate(seen):
        layer = i % len(blocks)
        assert block is blocks[layer]
        assert got_h == (layer > 0 and starts[layer])
        assert left_h == (layer + 1 < len(blocks) and starts[layer + 1])


@pytest.mark.slow  # a cold Inductor C++ compile of dynamic-shape pieces: ~30 s on two cores
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "clang++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
@torch.no_grad()
def test_inductor_compiled_prompt_steps_take_the_fused_rope_views(monkeypatch):
    """The same with Inductor (T dynamic): the views of a graph's output with a symbolic token
    count reach PagedKV.attend, and the logits are the eager engine's."""
    model = model_of(config(num_layers=2, **NO_QK_NORM))
    texts = prompts(5, seed=2, longest=30)
    params = [SamplingParams(max_tokens=4, greedy=True, ignore_eos=True)] * len(texts)
    _, eager, want, _ = recorded(model, monkeypatch, texts, params, max_batch_tokens=40)
    torch._dynamo.reset()
    compiled_prefill.compiled_prefill_layer.cache_clear()
    _, compiled, got, steps = recorded(model, monkeypatch, texts, params, "inductor",
                                       max_batch_tokens=40)
    assert len({t for _, t in steps}) >= 3
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [r.output_ids for r in compiled] == [r.output_ids for r in eager]


class FakeLayer:
    """A compiled_layer stand-in: x -> (x + 1, a new h), recording the h each call got."""

    def __init__(self):
        self.got = []

    def __call__(self, block, x, rope, states, step, h=None, following=None):
        self.got.append(h)
        return x + 1, (torch.full_like(x, 7.0) if following is not None else None)


@torch.no_grad()
def test_a_carry_reaches_only_the_next_call_with_that_very_x():
    """The carry goes to the next layer's call when its x is the x it was computed from, and
    nowhere else: not to a call with another x, not past `begin` (the next step), not into an
    eager step (which drops it)."""
    model = model_of(config(num_layers=3))
    engine = Engine(model, EngineSettings(block_size=4, max_running=2))
    cache, blocks = engine.cache, list(model.layers.values())
    fake = cache.compiled_layer = FakeLayer()
    long = dict(dtype=torch.long)
    decode = PagedStep(slot_ids=torch.zeros(2, **long), num_decode=2,
                       decode_tables=torch.zeros(2, 1, **long),
                       decode_lengths=torch.ones(2, **long))
    x = torch.zeros(1, 2, model.cfg.hidden_size)
    cache.begin(decode)
    x1 = cache.forward_layer(blocks[0], x, None, 0)
    assert isinstance(cache.carry, Carry) and cache.carry.x is x1 and cache.carry.block is blocks[1]
    x2 = cache.forward_layer(blocks[1], x1, None, 1)  # the very x: handed on
    assert fake.got[-1] is not None and torch.equal(fake.got[-1], torch.full_like(x, 7.0))
    cache.forward_layer(blocks[2], x2.clone(), None, 2)  # another x (same values): not
    assert fake.got[-1] is None and cache.carry is None  # the last layer leaves none
    x1 = cache.forward_layer(blocks[0], x, None, 0)
    cache.begin(decode)  # a new step: dropped
    assert cache.carry is None
    cache.forward_layer(blocks[1], x1, None, 1)
    assert fake.got[-1] is None
    x1 = cache.forward_layer(blocks[0], x, None, 0)
    cache.forward_layer(blocks[2], x1, None, 2)  # not the block it was computed for
    assert fake.got[-1] is None
    x1 = cache.forward_layer(blocks[0], x, None, 0)
    cache.compiled_layer = None  # an eager decode step's layer drops it
    cache.forward_layer(blocks[1], x1, None, 1)
    assert cache.carry is None


def fused_qkv_case(n_heads: int, n_kv: int, lengths: list[int], block: int, d: int,
                   seed: int = 0):
    """A decode case whose q [r, H, d], k_new, v_new [r, n_kv, d] are views of one fused row
    [r, (H + 2 n_kv) d] (the compiled pre's layout), and the same as contiguous copies."""
    case = paged_case(n_heads, n_kv, lengths, block=block, d=d, seed=seed)
    _, k_pool, v_pool, tables, lens = case
    gen = torch.Generator().manual_seed(seed + 7)
    rows = torch.randn(len(lengths), (n_heads + 2 * n_kv) * d, generator=gen)
    q = rows[:, : n_heads * d].unflatten(1, (n_heads, d))
    k = rows[:, n_heads * d : (n_heads + n_kv) * d].unflatten(1, (n_kv, d))
    v = rows[:, (n_heads + n_kv) * d :].unflatten(1, (n_kv, d))
    last = lens - 1
    slots = tables.gather(1, (last // block)[:, None])[:, 0] * block + last % block
    strided = (q, k_pool, v_pool, tables, lens), (k, v, slots)
    dense = (q.contiguous(), k_pool, v_pool, tables, lens), (k.contiguous(), v.contiguous(),
                                                              slots)
    return strided, dense


def run_both(strided, dense, launch):
    """launch(case, new) on fresh pool copies, strided and dense: (outputs, pools equal)."""
    outs, pools = [], []
    for case, new in (strided, dense):
        q, k_pool, v_pool, tables, lens = case
        k_pool, v_pool = k_pool.clone(), v_pool.clone()
        outs.append(launch((q, k_pool, v_pool, tables, lens), new))
        pools.append((k_pool, v_pool))
    same = all(torch.equal(a, b) for a, b in zip(*pools))
    return outs, same


def test_the_gather_path_takes_strided_q_k_v():
    strided, dense = fused_qkv_case(8, 2, [1, 5, 12], block=4, d=16)
    assert not strided[0][0].is_contiguous() and not strided[1][1].is_contiguous()
    (got, want), pools = run_both(strided, dense,
                                  lambda case, new: paged_decode_attention(*case, new=new))
    assert pools and torch.equal(got, want)


SCRIPT = BF16_DOT + """
import json, sys, torch
sys.path.insert(0, TESTS)
from test_compiled_decode_fusions import fused_qkv_case, run_both
import trireme.ops.paged_attention_triton as kernels
copies = []
real = torch.Tensor.contiguous
def counting(self, *args, **kwargs):
    copies.append(tuple(self.shape))
    return real(self, *args, **kwargs)
out = {}
for variant, kw in [("v1", {}), ("v1", dict(tile=16, splits=2)), ("v2", dict(heads=2, tile=16))]:
    strided, dense = fused_qkv_case(8, 2, [1, 6, 17], block=4, d=16, seed=1)
    torch.Tensor.contiguous = counting
    try:
        launch = lambda case, new: kernels.paged_decode_attention(*case, new=new,
                                                                  variant=variant, **kw)
        (got, want), pools = run_both(strided, dense, launch)
    finally:
        torch.Tensor.contiguous = real
    out[f"{variant} {kw}"] = {"err": (got - want).abs().max().item(), "pools": pools,
                              "copies": len(copies), "contiguous": got.is_contiguous()}
    copies.clear()
print(json.dumps(out))
"""


def test_the_triton_kernel_takes_strided_q_k_v_without_copies():
    """Through the interpreter: q, k_new, v_new views of one fused qkv row give the output and
    pools of contiguous copies (v1, split, v2), and the launch copies none of them."""
    pytest.importorskip("triton")
    script = SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert len(out) == 3, out
    for result in out.values():
        assert result["err"] == 0.0 and result["pools"] and result["contiguous"], out
        assert result["copies"] == 0, out


ENGINE_SCRIPT = """
import json, sys, torch
sys.path.insert(0, TESTS)
torch.set_num_threads(1)
from test_serve_engine import EagerGraphs, config, model_of, prompts
import trireme.models.paged as paged
import trireme.ops.paged_attention_triton as kernels
from trireme.serving.compiled_decode import compiled_layer
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.sampling import SamplingParams
model = model_of(config(qk_norm=False))
texts = prompts(5, seed=2, longest=12)
params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]

def tokens(compiled):
    engine = Engine(model, EngineSettings(block_size=4, max_running=4))
    if compiled:
        engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
        engine.cache.compiled_layer = compiled_layer("aot_eager")
    with torch.no_grad():
        return [r.output_ids for r in engine.generate(texts, params)]

want = tokens(False)  # eager: index_copy_, then the gather path
real, layouts = paged.paged_decode_attention, []
def through_kernel(q, k_pool, v_pool, tables, lengths, backend="auto", new=None, **engine):
    if new is None:  # engine: its KernelSettings and KernelFailures
        return real(q, k_pool, v_pool, tables, lengths, backend, **engine)
    layouts.append([q.is_contiguous(), new[0].is_contiguous(), new[1].is_contiguous()])
    return kernels.paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new,
                                          kernels=engine["kernels"])
paged.paged_decode_attention = through_kernel
got = tokens(True)
print(json.dumps({"want": want, "got": got, "layouts": layouts}))
"""


def test_compiled_decode_steps_hand_the_kernel_views_and_give_the_eager_tokens():
    """The llama shape's compiled decode steps (graph buckets, aot_eager) with the fused kernel
    (through the interpreter): q, k, v reach it as strided views of the qkv output, and the
    tokens are the eager engine's (index_copy_ + the gather path)."""
    pytest.importorskip("triton")
    script = ENGINE_SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert out["got"] == out["want"], out
    assert out["layouts"] and [False, False, False] in out["layouts"], out


@pytest.mark.slow  # cold Inductor C++ compiles of five pieces: ~20 s on two cores
@pytest.mark.skipif(not any(shutil.which(c) for c in (os.environ.get("CXX", "g++"), "clang++")),
                    reason="Inductor's CPU backend needs a C++ compiler")
def test_inductor_makes_fewer_kernels_per_layer(tmp_path):
    """bench/decode_kernels.py --smoke: the fused RoPE piece is one kernel (the C++ backend
    already merged the two RoPEs and the v copy into one, the norm is the other), and the
    next norm costs post_norm no kernel beyond post's (it rides in the last add's); the same
    GEMMs."""
    spec = importlib.util.spec_from_file_location("decode_kernels",
                                                  REPO / "bench" / "decode_kernels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "kernels.json"
    assert module.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    pieces, layer = data["pieces"], data["layer"]
    assert pieces["project"]["kernels"] == 1
    assert pieces["pre"]["kernels"] == pieces["project"]["kernels"] + 1  # + the input norm
    assert pieces["post_norm"]["kernels"] == pieces["post"]["kernels"]
    assert layer["after"]["kernels"] < layer["before"]["kernels"]
    assert layer["after"]["externs"] == layer["before"]["externs"]
