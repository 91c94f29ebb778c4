"""The chained decode (trireme.inference.chained_decode): decode steps whose residual adds and
norms ride in the split-K kernels (here their torch references, the plans forced on the CPU)
give the logits and tokens of the compiled steps without them; each layer's post goes through
the chain and each later layer's qkv through skinny_normed; a block that does not fit (GPT-2's
LayerNorm and GELU) keeps the compiled pieces."""

import json
from pathlib import Path

import pytest
import torch
from interpreted import BF16_DOT, run_in_interpreter
from test_paged_decode_raw import raw_run
from test_serve_engine import CONFIGS, config, model_of, prompts

import trireme.inference.chained_decode as chained_decode
import trireme.ops.skinny_gemm as skinny
from trireme.inference import compiled_decode
from trireme.inference.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def spy(monkeypatch, module, name, calls):
    real = getattr(module, name)

    def recorded(*args, **kwargs):
        out = real(*args, **kwargs)
        calls.append((name, out is not None))
        return out

    monkeypatch.setattr(module, name, recorded)


MODELS = {"llama": dict(qk_norm=False, num_layers=3), "qk-norm": dict(num_layers=3),
          "gpt2-learned-tied": None}
QKV_ROWS = (4 + 2 * 2) * 16  # the test configs' qkv weight: (heads + 2 kv heads) x head size


@pytest.mark.parametrize("kind,qkv_split", [("llama", True), ("llama", False),
                                           ("qk-norm", True), ("gpt2-learned-tied", True)])
@torch.no_grad()
def test_chained_decode_gives_the_compiled_logits_and_tokens(kind, qkv_split, monkeypatch):
    """With the qkv on a split plan its input norm rides in it too; without one (llama3-1b's
    qkv by default), or with QK-norm, the next layer's compiled pre norms the carried x."""
    overrides = MODELS[kind]
    model = model_of(config(**overrides) if overrides is not None else CONFIGS[kind])
    monkeypatch.setattr(skinny, "unavailable", lambda device: None)  # the engine swaps layers
    monkeypatch.setattr(skinny, "usable",  # every layer on a 2-split plan (the qkv: if asked)
                        lambda x, w: 2 if qkv_split or w.shape[0] != QKV_ROWS else None)
    monkeypatch.setattr(skinny, "glu_usable", lambda x, w: True)
    calls: list = []
    spy(monkeypatch, compiled_decode, "chained_post", calls)
    spy(monkeypatch, compiled_decode, "normed_qkv", calls)
    texts = prompts(5, seed=6, longest=14)
    params = [SamplingParams(max_tokens=2 + i % 3, greedy=True) for i in range(len(texts))]
    torch._dynamo.reset()
    want_ids, want = raw_run(model, monkeypatch, texts, params, True, chained=False)
    assert not calls
    torch._dynamo.reset()
    got_ids, got = raw_run(model, monkeypatch, texts, params, True, chained=True)
    assert got_ids == want_ids
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    posts = [ok for name, ok in calls if name == "chained_post"]
    qkvs = [ok for name, ok in calls if name == "normed_qkv"]
    if kind == "gpt2-learned-tied":  # LayerNorm, GELU: nothing fits
        assert not posts and not qkvs
        return
    # every layer's post chained; every later layer's qkv asked (3 layers: 3 posts, 2 qkvs a
    # step), normed by the kernel only on a split plan and without QK-norm
    assert posts and all(posts) and len(posts) == len(qkvs) * 3 // 2
    assert all(qkvs) if kind == "llama" and qkv_split else not any(qkvs)


def test_post_plan_needs_the_whole_shape(monkeypatch):
    """post_plan: the llama block fits (on forced plans); biases, another norm (LayerNorm,
    liger's RMSNorm) or MLP, a missing split, too few semaphores do not."""
    monkeypatch.setattr(skinny, "usable", lambda x, w: 2)
    monkeypatch.setattr(skinny, "glu_usable", lambda x, w: True)
    model = model_of(config(qk_norm=False))
    skinny.use_skinny_linears(model)
    block = next(iter(model.layers.values()))
    x = torch.zeros(1, 3, model.cfg.hidden_size)
    y = torch.zeros(3, model.cfg.num_attention_heads, 16)
    assert chained_decode.post_plan(block, x, y, "attention", ("mlp",)) is not None
    assert chained_decode.post_plan(block, x, None, "attention", ("mlp",)) is None
    assert chained_decode.post_plan(block, x, y, None, ("mlp",)) is None
    monkeypatch.setattr(skinny, "usable", lambda x, w: 1)  # one split: no semaphore to count
    assert chained_decode.post_plan(block, x, y, "attention", ("mlp",)) is None
    monkeypatch.setattr(skinny, "usable", lambda x, w: 2)
    monkeypatch.setattr(block.mlp_norm, "liger", True)  # liger's RMSNorm: not ours to fold
    assert chained_decode.post_plan(block, x, y, "attention", ("mlp",)) is None
    monkeypatch.undo()
    monkeypatch.setattr(skinny, "usable", lambda x, w: 2)
    monkeypatch.setattr(skinny, "glu_usable", lambda x, w: True)
    assert chained_decode.post_plan(block, x, y, "attention", ("mlp",)) is not None
    monkeypatch.setattr(chained_decode, "COUNTERS", 0)  # too few semaphores for the kernel
    assert chained_decode.post_plan(block, x, y, "attention", ("mlp",)) is None
    monkeypatch.setattr(chained_decode, "COUNTERS", 1024)
    for other in (config(qk_norm=False, bias=True), CONFIGS["gpt2-learned-tied"]):
        model = model_of(other)  # biases; LayerNorm and GELU
        skinny.use_skinny_linears(model)
        assert chained_decode.post_plan(next(iter(model.layers.values())), x, y, "attention",
                                        ("mlp",)) is None


ENGINE_SCRIPT = BF16_DOT + """
import json, sys, torch
sys.path.insert(0, TESTS)
torch.set_num_threads(1)
from test_compiled_decode import EagerGraphs
from test_serve_engine import config, model_of, prompts
import trireme.models.paged as paged
import trireme.ops.paged_attention_triton as attention_kernels
import trireme.ops.skinny_fused as fused
import trireme.ops.skinny_gemm as skinny
import trireme.ops.skinny_gemm_triton as gemm_kernels
from trireme.inference.compiled_decode import compiled_layer
from trireme.inference.engine import Engine, EngineSettings
from trireme.inference.sampling import SamplingParams
# a llama block whose shapes tile as the kernels' default tile (64 x 128): hidden 256
model = model_of(config(qk_norm=False, num_layers=3, hidden_size=256, ffn_hidden_size=256,
                        num_attention_heads=4, num_query_groups=2))
texts = prompts(4, seed=2, longest=10)
params = [SamplingParams(max_tokens=3 + i % 3, greedy=True) for i in range(len(texts))]

def tokens(chained):
    engine = Engine(model, EngineSettings(block_size=4, max_running=4))
    engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
    engine.cache.compiled_layer = compiled_layer("aot_eager", raw=chained, chained=chained)
    with torch.no_grad():
        return [r.output_ids for r in engine.generate(texts, params)]

want = tokens(False)
# the CPU runs the GPU's kernels now, through the interpreter: every layer on a 2-split plan,
# the ops' CPU implementations the Triton launchers, paged attention the kernel
skinny.unavailable = lambda device: None
skinny.usable = lambda x, w: 2
skinny.glu_usable = lambda x, w: True
launched = []
def residual(a, weight, splits, x):
    new, sumsq = torch.empty_like(x), x.new_empty(weight.shape[0] // 64, a.shape[0])
    counters = torch.zeros(64, dtype=torch.int32)
    gemm_kernels.skinny_mm(a.contiguous(), weight, splits, 64, 128, 16,
                           residual=(x.contiguous(), new, sumsq, counters))
    launched.append(("residual", int(counters.abs().sum())))
    return new, sumsq
def normed(x, sumsq, g, eps, weight, splits, glu):
    launched.append(("normed", glu))
    out = gemm_kernels.skinny_mm(x.contiguous(), weight, splits, 64, 128, 16, glu=glu,
                                 norm=(sumsq, g, eps))
    return out[0] if glu else out
fused.residual_reference = residual
fused._normed_torch = normed
real = paged.paged_decode_attention
def through_kernel(q, k_pool, v_pool, tables, lengths, backend="auto", new=None, rope=None):
    if new is None:
        return real(q, k_pool, v_pool, tables, lengths, backend)
    return attention_kernels.paged_decode_attention(q, k_pool, v_pool, tables, lengths,
                                                    new=new, rope=rope)
paged.paged_decode_attention = through_kernel
got = tokens(True)
print(json.dumps({"want": want, "got": got, "launched": launched}))
"""


@pytest.mark.slow  # two engines, one through the interpreter: ~25 s on two cores
def test_chained_decode_through_the_kernels_gives_the_eager_tokens():
    """The chained decode steps with the real kernels (Triton's interpreter: the split-K GEMMs
    with RESIDUAL and NORM, the paged kernel on planes with RoPE) give the tokens of the
    compiled steps without them; every semaphore is back at zero after its launch."""
    pytest.importorskip("triton")
    script = ENGINE_SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert out["got"] == out["want"], out
    kinds = {kind for kind, _ in out["launched"]}
    assert kinds == {"residual", "normed"}, out
    assert all(left == 0 for kind, left in out["launched"] if kind == "residual"), out
    assert [True, False] == sorted({glu for kind, glu in out["launched"] if kind == "normed"},
                                   reverse=True), out  # the gate-up GEMM and the qkv
