"""Decode attention over a paged KV pool: the gather + masked SDPA path equals plain attention of
each request over its own keys, and the Triton kernel (run on the CPU through Triton's
interpreter) equals the gather path, for MHA / GQA / MQA and lengths on and off block edges, with
the context in one piece or split over several programs."""

import json
from pathlib import Path

import pytest
import torch
from interpreted import BF16_DOT, run_in_interpreter

from trireme.ops.attention import reference_attention
from trireme.ops.paged_attention import paged_decode_reference


def paged_case(n_heads: int, n_kv: int, lengths: list[int], block: int = 4, d: int = 16,
               seed: int = 0):
    """q [r, H, d], pools, tables [r, W] (blocks scattered over the pool), lengths [r]."""
    gen = torch.Generator().manual_seed(seed)
    width = max(-(-n // block) for n in lengths) + 1  # one padding column at least
    num_blocks = 1 + len(lengths) * width
    k_pool = torch.randn(num_blocks, block, n_kv, d, generator=gen)
    v_pool = torch.randn(num_blocks, block, n_kv, d, generator=gen)
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0: padding
    tables = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        used = -(-n // block)
        tables[i, :used] = torch.tensor([order.pop() for _ in range(used)])
    q = torch.randn(len(lengths), n_heads, d, generator=gen)
    return q, k_pool, v_pool, tables, torch.tensor(lengths)


@pytest.mark.parametrize("n_heads,n_kv", [(4, 4), (4, 2), (6, 2), (4, 1)])
def test_gathered_paged_attention_equals_attention_per_request(n_heads, n_kv):
    q, k_pool, v_pool, tables, lengths = paged_case(n_heads, n_kv, [1, 4, 5, 11, 16])
    got = paged_decode_reference(q, k_pool, v_pool, tables, lengths)
    for i, n in enumerate(lengths.tolist()):
        blocks = k_pool[tables[i]].flatten(0, 1)[:n]  # [n, n_kv, d]: request i's keys in order
        values = v_pool[tables[i]].flatten(0, 1)[:n]
        want = reference_attention(q[i][None, :, None], blocks.transpose(0, 1)[None],
                                   values.transpose(0, 1)[None], causal=False)[0, :, 0]
        torch.testing.assert_close(got[i], want, atol=1e-5, rtol=1e-5)


SCRIPT = BF16_DOT + """
import json, sys, torch
sys.path.insert(0, TESTS)
from test_paged_attention import paged_case
from trireme.ops.paged_attention import paged_decode_reference
from trireme.ops.paged_attention_triton import paged_decode_attention
worst = 0.0
for n_heads, n_kv, block in [(6, 2, 16), (4, 1, 8)]:  # GQA with 3 groups (padded), MQA
    case = paged_case(n_heads, n_kv, [1, 16, 17, 70], block=block)
    got = paged_decode_attention(*case)
    want = paged_decode_reference(*case)
    worst = max(worst, (got - want).abs().max().item())
split = 0.0  # the context split over programs (some chunks empty), other tiles and launches
for splits, tile, warps, heads_first in [(2, 0, 4, True), (4, 32, 2, False), (16, 16, 8, True)]:
    case = paged_case(8, 2, [1, 16, 17, 70, 130], block=8)
    got = paged_decode_attention(*case, splits=splits, tile=tile, num_warps=warps,
                                 heads_first=heads_first, variant="v1")
    split = max(split, (got - paged_decode_reference(*case)).abs().max().item())
case = [t.bfloat16() if t.is_floating_point() else t for t in paged_case(4, 2, [5, 70], block=16)]
got = paged_decode_attention(*case).float()
want = paged_decode_reference(*[t.float() if t.is_floating_point() else t for t in case])
print(json.dumps({"worst": worst, "split": split, "bf16": (got - want).abs().max().item()}))
"""


def test_triton_paged_decode_kernel_equals_the_gather_path():
    pytest.importorskip("triton")
    script = SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert out["worst"] < 1e-4 and out["split"] < 1e-4 and out["bf16"] < 2e-2, out


VARIANTS_SCRIPT = BF16_DOT + """
import json, sys, torch
sys.path.insert(0, TESTS)
from test_paged_attention import paged_case
from trireme.ops.kernel_settings import KernelSettings
from trireme.ops.paged_attention import paged_decode_reference
import trireme.ops.paged_attention_triton as kernels
# (n_heads, n_kv, d, block, lengths): GQA 4:1 and 1:1, d 64 / 128, blocks 16 / 32, lengths 1,
# on a block edge (a full last block), just past one, and several blocks; batch 1 and many
shapes = [(8, 2, 64, 16, [1, 16, 17, 33, 64, 70, 5, 48, 31]), (4, 4, 128, 32, [1, 32, 33, 96]),
          (16, 4, 64, 32, [64]), (4, 4, 64, 16, [1])]
# (variant, launch settings): v1 as shipped, v2 with 1..4 kv heads per program, its loads
# prefetched or not, split or not
launches = [("v1", {}), ("v1", dict(tile=32, splits=2)), ("v2", {}),
            ("v2", dict(heads=2, tile=16, prefetch=True)), ("v2", dict(heads=4, tile=32, splits=4)),
            ("v2", dict(heads=2, tile=64, splits=2, num_warps=8, prefetch=True))]
errors = {}
for n_heads, n_kv, d, block, lengths in shapes:
    case = paged_case(n_heads, n_kv, lengths, block=block, d=d, seed=len(lengths))
    want = paged_decode_reference(*case)
    for variant, kw in launches:
        if kw.get("heads", 1) > n_kv:
            continue
        got = kernels.paged_decode_attention(*case, variant=variant, **kw)
        key = f"{variant} {kw}"
        errors[key] = max(errors.get(key, 0.0), (got - want).abs().max().item())
calls = []  # KernelSettings.paged_kernel picks v1 (not the default) when no variant is passed
for name in ("_paged_decode_kernel", "_paged_decode_v2_kernel"):
    jit = getattr(kernels, name)
    class Seen:
        def __getitem__(self, grid, jit=jit, name=name):
            calls.append((name, grid))
            return jit[grid]
    setattr(kernels, name, Seen())
chosen = KernelSettings(paged_kernel="v1,tile=16,num_warps=2")  # settings too
case = paged_case(8, 2, [5, 40], block=16, d=64)
got = kernels.paged_decode_attention(*case, kernels=chosen)
chosen_err = (got - paged_decode_reference(*case)).abs().max().item()
chosen_calls = list(calls)
bf16 = [t.bfloat16() if t.is_floating_point() else t for t in paged_case(8, 2, [5, 70], block=16)]
got = kernels.paged_decode_attention(*bf16, variant="v2", heads=2, tile=16).float()
want = paged_decode_reference(*[t.float() if t.is_floating_point() else t for t in bf16])
print(json.dumps({"errors": errors, "chosen": chosen_err, "calls": chosen_calls,
                  "bf16": (got - want).abs().max().item()}))
"""


def test_paged_decode_kernel_variants_equal_the_gather_path():
    """v1 and v2 (kv heads per program, prefetched tiles) against the gather reference through
    the interpreter; KernelSettings.paged_kernel "v1" (`--paged-kernel v1`) selects v1 (v2 is
    the default)."""
    pytest.importorskip("triton")
    script = VARIANTS_SCRIPT.replace("TESTS", repr(str(Path(__file__).parent)))
    out = json.loads(run_in_interpreter(script).splitlines()[-1])
    assert len(out["errors"]) == 6 and max(out["errors"].values()) < 1e-4, out
    assert out["calls"] == [["_paged_decode_kernel", [2, 2, 1]]] and out["chosen"] < 1e-4, out
    assert out["bf16"] < 2e-2, out  # bf16 dot operands (p rounded to bf16) against fp32


def test_the_paged_kernel_choice_is_parsed_and_checked():
    """KernelSettings.paged_kernel (`--paged-kernel`): a variant, then launch settings; an
    unknown name or setting is a one-line error when the engine's settings are checked."""
    from trireme.errors import ConfigError
    from trireme.ops.kernel_settings import KernelSettings, parse_paged_kernel
    from trireme.serving.engine import EngineSettings

    assert parse_paged_kernel(KernelSettings().paged_kernel) == ("v2", {})  # the default
    assert parse_paged_kernel("v1") == ("v1", {})
    assert parse_paged_kernel("v2, heads=2,tile=32") == ("v2", {"heads": 2, "tile": 32})
    with pytest.raises(ConfigError, match="paged_kernel 'v3': 'v3' is not.*v1, v2"):
        parse_paged_kernel("v3")
    with pytest.raises(ConfigError, match="'warps=8' is not a launch setting.*num_warps"):
        parse_paged_kernel("v2,warps=8")
    with pytest.raises(ConfigError, match="paged_kernel 'v2,tile=x': 'tile=x' is not a launch"):
        EngineSettings(paged_kernel="v2,tile=x").check()
    EngineSettings(paged_kernel="v1,heads_first=1").check()


def test_paged_decode_kernel_settings_are_checked():
    pytest.importorskip("triton")
    from trireme.errors import ConfigError
    from trireme.ops.paged_attention_triton import paged_decode_attention

    case = paged_case(8, 4, [3, 9], block=4)
    for heads in (3, 8, 16):  # not a power of two, more than the kv heads
        with pytest.raises(ConfigError, match=f"heads={heads} kv heads per program"):
            paged_decode_attention(*case, variant="v2", heads=heads)
    with pytest.raises(ConfigError, match="splits=3 must be a power of two"):
        paged_decode_attention(*case, variant="v1", splits=3)
    with pytest.raises(ConfigError, match="variant='v9' is not"):
        paged_decode_attention(*case, variant="v9")


def test_kernel_configs_sweep_runs_both_variants(tmp_path):
    """bench/serve_profile.py --kernel-configs on a tiny model through the interpreter: every
    setting of both variants agrees with the gather path, and the shipped default is timed, also
    with the step's keys stored by the kernel."""
    pytest.importorskip("triton")
    out = tmp_path / "configs.json"
    argv = ["serve_profile.py", "--smoke", "--kernel-configs", "--tiles",
            "16", "--warps", "4", "--splits", "0", "--heads", "1,2", "--heads-first", "0,1",
            "--block-size", "8", "--out", str(out)]
    bench = Path(__file__).resolve().parent.parent / "bench" / "serve_profile.py"
    run_in_interpreter(f"import runpy, sys; sys.argv = {argv!r}; "
                       f"runpy.run_path({str(bench)!r}, run_name='__main__')")
    data = json.loads(out.read_text())
    rows = data["rows"]
    # the shipped kernel storing the step's keys itself agrees with index_copy_ then the kernel
    assert [r["batch"] for r in data["fused_store"]] == [1, 4], data["fused_store"]
    for r in data["fused_store"]:
        assert r["pools_equal"] and r["max_err"] < 1e-4 and r["fused_us"] > 0, r
    settings = [(r["batch"], r["variant"], r.get("heads_first"), r.get("heads"),
                 r.get("prefetch")) for r in rows]
    v2 = [("v2", None, h, f) for h in (1, 2) for f in (False, True)]
    assert settings == [(b, *s) for b in (1, 4) for s in [
        ("default", None, None, None), ("v1", False, None, None), ("v1", True, None, None),
        *v2]], rows
    assert all(r["ok"] and r["us"] > 0 for r in rows), rows
    assert [r["baseline"] for r in rows].count(True) == 2


def test_both_variants_compile_for_the_h200_without_a_gpu(tmp_path, monkeypatch):
    """bench/paged_kernel_static.py compiles v1 and v2 for sm_90 (Triton's compiler and ptxas,
    no device): both loops are pipelined through cp.async, and no registers spill; with the
    step's keys stored by the kernel (--new) the tile loop is the same length."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import paged_kernel_static

    found = {}
    for new in ([], ["--new"]):
        out = tmp_path / "static.json"
        paged_kernel_static.main(["--settings", "v1:1:64:4:0", "v2:2:32:4:0", "--out", str(out),
                                  *new])
        rows = found[bool(new)] = json.loads(out.read_text())["rows"]
        assert [r.get("error") for r in rows] == [None, None], rows
        for r in rows:
            assert r["registers"] > 0 and r["spill_bytes"] == 0 and r["loop_instructions"] > 0, r
            assert r["cp_async"] > 0, r
    assert ([r["loop_instructions"] for r in found[True]]
            == [r["loop_instructions"] for r in found[False]]), found
