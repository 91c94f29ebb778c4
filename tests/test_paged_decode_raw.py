"""The paged decode kernels on the compiled decode step's raw inputs (trireme.ops.decode_inputs):
q, k_new, v_new as planes of a split qkv projection and unrotated with `rope`. Through Triton's
interpreter, v1 and v2, one plane and several, with and without RoPE, give what summing,
rotating (decode_inputs.prepared) and then the fused store + attention give: the same output and
the same pools; the gather path (CPU) does exactly that; bad inputs get one-line errors."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from interpreted import BF16_DOT, BF16_ROUND, run_in_interpreter
from test_compiled_decode import EagerGraphs, sampled_logits
from test_paged_decode_store import new_case, stored_then_attended

from trireme.inference.compiled_decode import compiled_layer
from trireme.inference.engine import Engine, EngineSettings
from trireme.inference.sampling import SamplingParams
from trireme.ops.decode_inputs import prepared
from trireme.ops.paged_attention import paged_decode_attention
from trireme.ops.rope import RotaryEmbedding, rope_frequencies


def raw_case(n_heads: int, n_kv: int, lengths: list[int], block: int, d: int, planes: int,
             seed: int = 0):
    """new_case's case with q, k_new, v_new replaced by `planes` planes [S, r, heads, d] (fp32;
    planes == 0: 3-D, one plane) and rope (cos, sin [r, d]) at each request's last position."""
    case, (_, _, slots) = new_case(n_heads, n_kv, lengths, block, d, seed=seed)
    gen = torch.Generator().manual_seed(seed + 7)
    r = len(lengths)
    lead = (planes,) if planes else ()
    scale = max(planes, 1) ** -0.5  # the sums' variance 1
    q, k, v = (torch.randn(*lead, r, h, d, generator=gen) * scale for h in (n_heads, n_kv, n_kv))
    rotary = RotaryEmbedding(d, 64, rope_frequencies(d, theta=500.0))
    rope = rotary(torch.device("cpu"), position_ids=case[4] - 1)  # [r, d] each
    return (q, *case[1:]), (k, v, slots), rope


def prepared_reference(case, new, rope):
    """decode_inputs.prepared, then store + attend (test_paged_decode_store's reference)."""
    q, k, v = prepared(case[0], new[0], new[1], rope, case[1].dtype)
    return stored_then_attended((q, *case[1:]), (k, v, new[2]))


def test_gather_path_sums_and_rotates_first():
    case, new, rope = raw_case(4, 2, [1, 5, 9], block=4, d=16, planes=3)
    want, k_want, v_want = prepared_reference(case, new, rope)
    q, k_pool, v_pool, tables, lengths = case
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new, rope=rope)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)
    plain = paged_decode_attention(case[0].sum(0), k_pool.clone(), v_pool.clone(), tables,
                                   lengths, new=(new[0].sum(0), new[1].sum(0), new[2]))
    assert (got - plain).abs().max() > 1e-3  # the rotation changes the answer


def test_raw_inputs_are_checked():
    case, new, rope = raw_case(4, 2, [3, 9], block=4, d=16, planes=2)
    q, k_pool, v_pool, tables, lengths = case
    with pytest.raises(ValueError, match="planes of q or `rope` come with `new`"):
        paged_decode_attention(q, k_pool, v_pool, tables, lengths)
    if importlib.util.find_spec("triton") is not None:  # the launcher says so too
        from trireme.ops.paged_attention_triton import paged_decode_attention as launch
        with pytest.raises(ValueError, match="`rope` comes with `new`"):
            launch(q[0], k_pool, v_pool, tables, lengths, rope=rope)
    with pytest.raises(ValueError, match=r"rope cos is \(2, 8\).*must be \[2, 16\] float32"):
        paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new,
                               rope=(rope[0][:, :8], rope[1]))


SCRIPT = BF16_DOT + BF16_ROUND + """
import json, sys, torch
sys.path.insert(0, TESTS)
from test_paged_decode_raw import raw_case, prepared_reference
from trireme.inference.sampling import SamplingParams
from trireme.ops.decode_inputs import prepared
import trireme.ops.paged_attention_triton as kernels
launches = [("v1", {}), ("v2", {}), ("v2", dict(heads=2, tile=16, splits=4)),
            ("v2", dict(heads=1, tile=16, splits=2, prefetch=True))]
out, pools = {}, {}
for planes in (0, 1, 3):
    for rotate in (False, True):
        for n_heads, n_kv, d, block, lengths in [(8, 2, 16, 4, [1, 4, 5, 17, 33]),
                                                 (4, 2, 32, 8, [1, 9, 24])]:
            case, new, rope = raw_case(n_heads, n_kv, lengths, block, d, planes, seed=planes)
            rope = rope if rotate else None
            want, k_want, v_want = prepared_reference(case, new, rope)
            for variant, kw in launches:
                q, k_pool, v_pool, tables, lens = case
                k_pool, v_pool = k_pool.clone(), v_pool.clone()
                got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, new=new,
                                                     rope=rope, variant=variant, **kw)
                key = f"{planes} {rotate} {variant} {kw}"
                out[key] = max(out.get(key, 0.0), (got - want).abs().max().item())
                pools[key] = pools.get(key, True) and torch.equal(k_pool, k_want) and \\
                    torch.equal(v_pool, v_want)
# bf16 pools, one bf16 plane (the cuBLAS projection's) and fp32 planes, rotated: the same
# output as the kernel on decode_inputs.prepared's bf16 q, k, v (and the same pools)
for planes in (1, 4):
    case, new, rope = raw_case(8, 2, [1, 16, 21], 8, 16, planes, seed=5)
    bf = lambda t: t.bfloat16() if t.is_floating_point() else t
    case = [case[0] if planes > 1 else bf(case[0]), *[bf(t) for t in case[1:]]]
    new = [t if planes > 1 or not t.is_floating_point() else bf(t) for t in new]
    q, k, v = prepared(case[0], new[0], new[1], rope, torch.bfloat16)
    runs = []
    for inputs, extra in [((q, (k, v, new[2])), {}), ((case[0], new), dict(rope=rope))]:
        k_pool, v_pool = case[1].clone(), case[2].clone()
        got = kernels.paged_decode_attention(inputs[0], k_pool, v_pool, *case[3:], new=inputs[1],
                                             variant="v2", heads=2, tile=16, **extra)
        runs.append((got, k_pool, v_pool))
    (want, k_want, v_want), (got, k_pool, v_pool) = runs
    out[f"bf16 {planes}"] = (got.float() - want.float()).abs().max().item()
    pools[f"bf16 {planes}"] = torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)
print(json.dumps({"errors": out, "pools": pools}))
"""


def test_kernels_sum_and_rotate_as_prepared_in_the_interpreter():
    pytest.importorskip("triton")
    script = SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    errors = out["errors"]
    assert len(errors) == 3 * 2 * 4 + 2, out
    assert max(v for k, v in errors.items() if not k.startswith("bf16")) < 1e-4, out
    assert errors["bf16 1"] == 0 and errors["bf16 4"] == 0, out
    assert all(out["pools"].values()), out


def raw_run(model, monkeypatch, texts, params, raw: bool, chained: bool = False):
    """(token ids, logits rows) of test_compiled_decode.recorded_run's engine with the blocks
    compiled by aot_eager; `raw`: the raw qkv inputs (compiled_decode._project_raw), `chained`
    (with raw): trireme.inference.chained_decode."""
    with sampled_logits(monkeypatch) as rows:
        engine = Engine(model, EngineSettings(block_size=4, max_running=4, max_batch_tokens=16))
        engine.graphs = EagerGraphs(model, engine.cache, 4, 4)
        engine.cache.compiled_layer = compiled_layer("aot_eager", raw=raw, chained=chained)
        requests = engine.generate(texts, params)
    return [r.output_ids for r in requests], torch.stack(rows)


@pytest.mark.parametrize("kind,splits", [("llama", 0), ("llama", 2), ("gpt2-learned-tied", 0),
                                         ("llama-gqa-untied", 0)])
@torch.no_grad()
def test_raw_qkv_decode_gives_the_eager_logits_and_tokens(kind, splits, monkeypatch):
    """Decode steps whose paged attention takes the qkv projection raw (planes of a split-K
    product with `splits`, else the product; RoPE applied in the attention) give the logits and
    tokens of the compiled steps without it: the llama shape (RoPE, GQA, no QK-norm), GPT-2's
    (no RoPE), and one with QK-norm (which keeps the rotated path)."""
    from test_serve_engine import CONFIGS, config, model_of, prompts

    import trireme.ops.skinny_gemm as skinny
    from trireme.inference import compiled_decode

    model = model_of(config(qk_norm=False) if kind == "llama" else CONFIGS[kind])
    planes = []
    if splits:  # the kernel's plan off the GPU: every linear layer split (torch's reference)
        monkeypatch.setattr(skinny, "unavailable", lambda device: None)  # the engine swaps
        monkeypatch.setattr(skinny, "usable", lambda x, w: splits)
    real = compiled_decode.linear_planes
    monkeypatch.setattr(compiled_decode, "linear_planes",
                        lambda layer, x: planes.append(real(layer, x)) or planes[-1])
    texts = prompts(5, seed=3, longest=14)
    params = [SamplingParams(max_tokens=2 + i % 3, greedy=True) for i in range(len(texts))]
    torch._dynamo.reset()
    want_ids, want = raw_run(model, monkeypatch, texts, params, raw=False)
    torch._dynamo.reset()
    got_ids, got = raw_run(model, monkeypatch, texts, params, raw=True)
    assert got_ids == want_ids
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # the raw path ran (traced once per graph) where there is no QK-norm, with the planes
    assert bool(planes) == (not model.cfg.qk_norm)
    assert all(p.shape[0] == max(splits, 1) for p in planes)
