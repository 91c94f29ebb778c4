"""RoPE inside the paged decode kernel (trireme.ops.paged_attention, `rope=`): q and this step's
keys handed in un-rotated, with each request's cos / sin row, give what rotating them first
(trireme.ops.rope.apply_rotary_heads) and then storing and attending gives, on the gather path
(CPU) and in both kernels (v2 rotates as it reads, v1 is handed them rotated), and the pools hold
the rotated keys."""

import json
from pathlib import Path

import pytest
import torch
from interpreted import BF16_DOT, compile_for_sm90, run_in_interpreter
from test_paged_decode_store import new_case, stored_then_attended

from trireme.ops.paged_attention import paged_decode_attention
from trireme.ops.rope import RotaryEmbedding, apply_rotary_heads, rope_frequencies


def rope_case(n_heads: int, n_kv: int, lengths: list[int], block: int, d: int, seed: int = 0,
              strided: bool = False):
    """new_case plus cos, sin [r, d] fp32 of each request's new position (lengths - 1), from
    the model's rotary table (llama3 scaling: frequencies of every size)."""
    case, new = new_case(n_heads, n_kv, lengths, block, d, seed=seed, strided=strided)
    table = RotaryEmbedding(d, 256, rope_frequencies(d, 500000.0, "llama3", 32.0, 1.0, 4.0, 64))
    cos, sin = table(torch.device("cpu"), position_ids=case[4] - 1)
    return case, new, (cos, sin)


def rotated_first(case, new, rope):
    """The reference: q and k_new rotated by torch, then store and attend."""
    q, *rest = case
    k_new, v_new, slots = new
    return stored_then_attended([apply_rotary_heads(q, *rope), *rest],
                                (apply_rotary_heads(k_new, *rope), v_new, slots))


def test_gather_path_rotates_then_stores_and_attends():
    case, new, rope = rope_case(6, 2, [1, 4, 5, 11], block=4, d=16, strided=True)
    want, k_want, v_want = rotated_first(case, new, rope)
    q, k_pool, v_pool, tables, lengths = case
    unrotated = paged_decode_attention(q, k_pool.clone(), v_pool.clone(), tables, lengths,
                                       new=new)
    got = paged_decode_attention(q, k_pool, v_pool, tables, lengths, new=new, rope=rope)
    assert torch.equal(k_pool, k_want) and torch.equal(v_pool, v_want)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (got - unrotated).abs().max() > 1e-2  # the rotation matters


SCRIPT = BF16_DOT + """
import json, sys, torch
sys.path.insert(0, TESTS)
from test_paged_decode_rope import rope_case, rotated_first
import trireme.ops.paged_attention_triton as kernels
shapes = [(8, 2, 16, 4, [1, 4, 5, 16, 17, 33, 8, 32], False),
          (4, 2, 32, 8, [1, 9, 24, 40], True)]
launches = [("v1", {}), ("v2", {}), ("v2", dict(heads=2, tile=16, prefetch=True)),
            ("v2", dict(heads=2, tile=16, splits=4)),
            ("v2", dict(heads=1, tile=16, splits=2, prefetch=True))]
out, pools = {}, {}
for n_heads, n_kv, d, block, lengths, strided in shapes:
    case, new, rope = rope_case(n_heads, n_kv, lengths, block, d, seed=len(lengths),
                                strided=strided)
    want, k_want, v_want = rotated_first(case, new, rope)
    for variant, kw in launches:
        q, k_pool, v_pool, tables, lens = case
        k_pool, v_pool = k_pool.clone(), v_pool.clone()
        got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, new=new,
                                             rope=rope, variant=variant, **kw)
        key = f"{variant} {kw}"
        out[key] = max(out.get(key, 0.0), (got - want).abs().max().item())
        pools[key] = max(pools.get(key, 0.0), (k_pool - k_want).abs().max().item(),
                         (v_pool - v_want).abs().max().item())
# bf16 (the GPU's): q and the key rotated in fp32 and rounded once, as the compiled RoPE does
bf = lambda t: t.bfloat16() if t.is_floating_point() else t
case, new, rope = rope_case(8, 2, [1, 16, 21], 8, 16, seed=3)
case, new = [bf(t) for t in case], [bf(t) for t in new]
want, k_want, v_want = rotated_first(case, new, rope)
q, k_pool, v_pool, tables, lens = case
got = kernels.paged_decode_attention(q, k_pool, v_pool, tables, lens, new=new, rope=rope,
                                     variant="v2", heads=2, tile=16)
ulp = (k_want.float().abs() * 2 ** -7).clamp_min(1e-30)  # one bf16 step at each key's size
bf16 = {"err": (got.float() - want.float()).abs().max().item(),
        "key_ulps": ((k_pool.float() - k_want.float()).abs() / ulp).max().item(),
        "values": torch.equal(v_pool, v_want)}
print(json.dumps({"errors": out, "pools": pools, "bf16": bf16}))
"""


def test_kernels_rotate_as_rotating_first_in_the_interpreter():
    pytest.importorskip("triton")
    script = SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert len(out["errors"]) == 5 and max(out["errors"].values()) < 1e-4, out
    assert max(out["pools"].values()) < 1e-5, out  # fp32: the same products, maybe an FMA
    assert out["bf16"]["err"] < 2e-2 and out["bf16"]["key_ulps"] <= 1 and out["bf16"]["values"]


def test_rope_rows_are_checked():
    pytest.importorskip("triton")
    from trireme.ops.paged_attention_triton import rope_rows

    case, _, (cos, sin) = rope_case(4, 2, [3, 9], block=4, d=16)
    q = case[0]
    with pytest.raises(ValueError, match=r"rope cos is \(2, 8\).*must be \(2, 16\)"):
        rope_rows((cos[:, :8], sin), q)
    with pytest.raises(ValueError, match="rope sin .* torch.bfloat16 .*torch.float32"):
        rope_rows((cos, sin.bfloat16()), q)
    wide = torch.zeros(2, 32)
    got = rope_rows((cos, wide[:, :16].copy_(sin)), q)  # another row stride: made contiguous
    assert got[0].stride() == got[1].stride() == (16, 1) and torch.equal(got[1], sin)


def test_v2_with_rope_compiles_for_sm90():
    pytest.importorskip("triton")
    import trireme.ops.paged_attention_triton as kernels

    pointers = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "k_new_ptr",
                                     "v_new_ptr")}
    pointers.update({n: "*fp32" for n in ("part_m_ptr", "part_l_ptr", "part_acc_ptr",
                                          "cos_ptr", "sin_ptr")})
    pointers.update({n: "*i64" for n in ("tables_ptr", "lengths_ptr", "slots_ptr")})
    pointers["scale"] = "fp32"
    for rope in (False, True):
        consts = dict(GROUPS=4, GROUPS_POW2=16, HEADS=2, D=64, BLOCK=16, TILE=64, SPLITS=1,
                      PREFETCH=False, NEW=True, ROPE=rope)
        kernel = compile_for_sm90(kernels._paged_decode_v2_kernel, consts, pointers, 2, 2)
        assert "mma" in kernel.asm["ptx"], rope  # the products on the tensor cores
