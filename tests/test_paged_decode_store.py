"""The paged decode kernels' fused store (trireme.ops.paged_attention_triton, `new=`): one launch
that writes this step's keys and values into the pools and attends with them gives the output of
"index_copy_ into the pools, then attend" and leaves the pools bitwise as index_copy_ does, for
v1 and v2, one split and several, GQA, lengths 1 (only the new key) and on block and tile edges;
and the dispatcher's gather path (CPU, no Triton) stores then attends."""

import json
from pathlib import Path

import pytest
import torch
from interpreted import BF16_DOT, run_in_interpreter
from test_paged_attention import paged_case

from trireme.ops.paged_attention import (
    paged_decode_attention,
    paged_decode_reference,
    store_new,
)


def new_case(n_heads: int, n_kv: int, lengths: list[int], block: int, d: int, seed: int = 0,
             strided: bool = False):
    """paged_case plus this step's keys, values [r, n_kv, d] and their pool rows [r] (the slot
    of position lengths[i] - 1 through request i's table); `strided`: k, v [r, n_kv, d] views
    with different strides (as the eager forward's)."""
    q, k_pool, v_pool, tables, lens = paged_case(n_heads, n_kv, lengths, block=block, d=d,
                                                 seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    r = len(lengths)
    k_new, v_new = (torch.randn(r, n_kv, d, generator=gen) for _ in range(2))
    if strided:  # k a view of [n_kv, r, d], v of [r, n_kv, 2 d]: strides of their own
        k_new = torch.randn(n_kv, r, d, generator=gen).transpose(0, 1)
        v_new = torch.randn(r, n_kv, 2 * d, generator=gen)[..., :d]
    last = lens - 1
    slots = tables.gather(1, (last // block)[:, None])[:, 0] * block + last % block
    return (q, k_pool, v_pool, tables, lens), (k_new, v_new, slots)


def stored_then_attended(case, new):
    """The reference: index_copy_ into copies of the pools, then the gather path."""
    q, k_pool, v_pool, tables, lengths = case
    k_pool, v_pool = k_pool.clone(), v_pool.clone()
    store_new(k_pool, v_pool, new)
    return paged_decode_reference(q, k_pool, v_pool, tables, lengths), k_pool, v_pool


def test_gather_path_stores_then_attends():
    """Without the kernel (CPU) `new` is index_copy_ then the gather path; the new keys count:
    attending without storing them gives another answer."""
    case, new = new_case(6, 2, [1, 4, 5, 11], block=4, d=16, strided=True)
    want, k_want, v_want = stored_then_attended(case, new)
    q, k_pool, v_pool, tables, lengths = case
    before = paged_decode_reference(*case)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new)
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got - before).abs().max() > 1e-3


SCRIPT = BF16_DOT + """
import json, sys, torch
sys.path.insert(0, TESTS)
from test_paged_decode_store import new_case, stored_then_attended
import trireme.ops.paged_attention_triton as kernels
# (n_heads, n_kv, d, block, lengths, strided): GQA 4:1 and 2:1, lengths 1 (only the new key),
# ending on a block edge (4, 8, 16, 32), just past one, on a 16-key tile edge (16, 32) and past
# it (17, 33), and an eager-layout (strided) k_new
shapes = [(8, 2, 16, 4, [1, 4, 5, 16, 17, 33, 8, 32], False),
          (4, 2, 32, 8, [1, 9, 24, 40], True)]
launches = [("v1", {}), ("v1", dict(tile=16, splits=4)),
            ("v1", dict(tile=16, splits=2, heads_first=True)),
            ("v2", {}), ("v2", dict(heads=2, tile=16, prefetch=True)),
            ("v2", dict(heads=2, tile=16, splits=4)),
            ("v2", dict(heads=1, tile=16, splits=2, prefetch=True))]
out, pools = {}, {}
for n_heads, n_kv, d, block, lengths, strided in shapes:
    case, new = new_case(n_heads, n_kv, lengths, block, d, seed=len(lengths), strided=strided)
    want, k_want, v_want = stored_then_attended(case, new)
    for variant, kw in launches:
        q, k_pool, v_pool, tables, lens = case
        k_pool, v_pool = k_pool.clone(), v_pool.clone()
        got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, new=new,
                                             variant=variant, **kw)
        key = f"{variant} {kw}"
        out[key] = max(out.get(key, 0.0), (got - want).abs().max().item())
        pools[key] = pools.get(key, True) and torch.equal(k_pool, k_want) and torch.equal(
            v_pool, v_want)
# bf16 pools (the GPU's): stored bits equal index_copy_'s, output near the fp32 reference
case, new = new_case(8, 2, [1, 16, 21], 8, 16, seed=3)
bf = lambda t: t.bfloat16() if t.is_floating_point() else t
case, new = [bf(t) for t in case], [bf(t) for t in new]
want, k_want, v_want = stored_then_attended([t.float() if t.is_floating_point() else t
                                             for t in case], [t.float() if t.is_floating_point()
                                                              else t for t in new])
q, k_pool, v_pool, tables, lens = case
got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, new=new, variant="v2",
                                     heads=2, tile=16)
bf16 = {"err": (got.float() - want).abs().max().item(),
        "pools": torch.equal(k_pool, k_want.bfloat16()) and torch.equal(v_pool, v_want.bfloat16())}
print(json.dumps({"errors": out, "pools": pools, "bf16": bf16}))
"""


def test_fused_store_equals_store_then_attend_in_the_interpreter():
    pytest.importorskip("triton")
    script = SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert len(out["errors"]) == 7 and max(out["errors"].values()) < 1e-4, out
    assert all(out["pools"].values()), out
    assert out["bf16"]["pools"] and out["bf16"]["err"] < 2e-2, out


def test_new_keys_are_checked():
    pytest.importorskip("triton")
    from trireme.ops.paged_attention_triton import new_keys

    case, (k_new, v_new, slots) = new_case(4, 2, [3, 9], block=4, d=16)
    q, k_pool, v_pool = case[:3]
    with pytest.raises(ValueError, match=r"k_new is \(2, 2, 8\).*must be \(2, 2, 16\)"):
        new_keys((k_new[..., :8], v_new, slots), q, k_pool, v_pool)
    with pytest.raises(ValueError, match="v_new is .*bfloat16.*must be .*float32"):
        new_keys((k_new, v_new.bfloat16(), slots), q, k_pool, v_pool)
    with pytest.raises(ValueError, match=r"slots is \(3,\); it must be \[2\]"):
        new_keys((k_new, v_new, torch.zeros(3, dtype=torch.long)), q, k_pool, v_pool)
    strided = k_new.transpose(0, 1).contiguous().transpose(0, 1)  # kept: unit column stride
    k, v, _ = new_keys((strided, v_new[..., ::1], slots), q, k_pool, v_pool)
    assert k.data_ptr() == strided.data_ptr() and v.data_ptr() == v_new.data_ptr()
    spread = torch.randn(2, 2, 32)[..., ::2]  # columns 2 apart: copied
    k, _, _ = new_keys((spread, v_new, slots), q, k_pool, v_pool)
    assert k.stride(-1) == 1 and torch.equal(k, spread)


ENGINE_SCRIPT = """
import json, sys, torch
sys.path.insert(0, TESTS)
torch.set_num_threads(1)
from test_serve_engine import CONFIGS, EagerGraphs, model_of, prompts
import trireme.models.paged as paged
import trireme.ops.paged_attention_triton as kernels
from trireme.serving.compiled_decode import compiled_layer
from trireme.serving.engine import Engine, EngineSettings
from trireme.serving.sampling import SamplingParams
model = model_of(CONFIGS["llama-gqa-untied"])
texts = prompts(5, seed=2, longest=12)
params = [SamplingParams(max_tokens=3 + i % 4, greedy=True) for i in range(len(texts))]

def tokens(graphs, compiled):
    engine = Engine(model, EngineSettings(block_size=4, max_running=4))
    if graphs:  # decode steps padded to buckets 1, 2, 4: padding rows write slot 0
        engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
    if compiled:
        engine.cache.compiled_layer = compiled_layer("aot_eager")
    with torch.no_grad():
        return [r.output_ids for r in engine.generate(texts, params)]

want = tokens(False, False)  # index_copy_, then the gather path
real, fused = paged.paged_decode_attention, []
def through_kernel(q, k_pool, v_pool, tables, lengths, backend="auto", new=None, **engine):
    if new is None:  # engine: its KernelSettings and KernelFailures
        return real(q, k_pool, v_pool, tables, lengths, backend, **engine)
    fused.append(q.shape[0])  # the CPU dispatcher would gather: run the kernel as CUDA would
    return kernels.paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new,
                                          kernels=engine["kernels"])
paged.paged_decode_attention = through_kernel
got, calls = {}, {}
for name, graphs, compiled in [("eager", False, False), ("graphs", True, False),
                               ("compiled", True, True)]:
    fused.clear()
    got[name] = tokens(graphs, compiled)
    calls[name] = sorted(set(fused))
print(json.dumps({"want": want, "got": got, "calls": calls}))
"""


def test_engine_decode_steps_through_the_fused_kernel_give_the_same_tokens():
    """The engine's decode-only steps (eager, padded graph buckets, compiled pieces) with the
    fused kernel (through the interpreter) give the tokens of index_copy_ + the gather path."""
    pytest.importorskip("triton")
    script = ENGINE_SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert all(tokens == out["want"] for tokens in out["got"].values()), out
    assert out["calls"]["eager"] and set(out["calls"]["graphs"]) <= {1, 2, 4}, out
    assert 4 in out["calls"]["graphs"] and out["calls"]["compiled"], out


def test_a_failing_kernel_falls_back_and_still_stores(monkeypatch):
    """When the kernel fails (a Triton compile error), the call warns, stores the new keys with
    index_copy_ and attends on the gather path: the same output and pools. The failure is
    recorded in the caller's KernelFailures (an engine's), whose owner does not try the kernel
    again; a caller with a record of its own still does."""
    import contextlib

    import trireme.ops.paged_attention as dispatch
    from trireme.ops.kernel_settings import KernelFailures

    calls = []

    def failing(*args, new=None, kernels=None):
        calls.append(new)
        raise RuntimeError("no kernel today")

    monkeypatch.setattr(dispatch, "_fits_kernel", lambda q, k_pool, backend: True)
    monkeypatch.setattr(dispatch, "_kernel", lambda: failing)
    monkeypatch.setattr(dispatch.torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(dispatch.torch.cuda, "is_current_stream_capturing", lambda: False)
    case, new = new_case(4, 2, [1, 6, 9], block=4, d=16)
    want, k_want, v_want = stored_then_attended(case, new)
    q, k_pool, v_pool, tables, lengths = case
    failures, others = KernelFailures(), KernelFailures()
    with pytest.warns(UserWarning, match="paged decode kernel failed.*no kernel today"):
        got = dispatch.paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new,
                                              failures=failures)
    assert calls == [new] and list(failures.errors) == ["paged_attention"]
    assert not dispatch.kernel_available(failures) and not others.errors
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    dispatch.paged_decode_attention(q, k_pool, v_pool, tables, lengths, failures=failures)
    assert len(calls) == 1  # not tried again for the owner of `failures`
    with pytest.warns(UserWarning, match="paged decode kernel failed"):  # another engine's
        dispatch.paged_decode_attention(q, k_pool, v_pool, tables, lengths, failures=others)
    assert len(calls) == 2 and "paged_attention" in others
