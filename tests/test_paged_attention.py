"""Decode attention over a paged KV pool: the gather + masked SDPA path equals plain attention of
each request over its own keys, and the Triton kernel (run on the CPU through Triton's
interpreter) equals the gather path, for MHA / GQA / MQA and lengths on and off block edges, with
the context in one piece or split over several programs."""

import json
from pathlib import Path

import pytest
import torch
from interpreted import run_in_interpreter

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


SCRIPT = """
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
                                 heads_first=heads_first)
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
