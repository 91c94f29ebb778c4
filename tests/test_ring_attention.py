"""Ring attention's pieces and the context-parallel modes against full attention in one process.

The LSE merge: the keys cut into random blocks (2-4, positions shuffled), each block's partial
attention merged, equals attention over all keys, forward and gradients, causal (by global
position) and not; so does the flash-style block backward. The modes: C = 2 and 4 gloo ranks each
hold their zigzag slice of q, k, v; the output and the gradients of the slices equal full causal
attention (GQA: 2C query heads, C key/value heads, so that a2a can cut them).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.distributed import run_ranks
from trireme.ops.attention_lse import (
    attention_block_backward,
    attention_delta,
    attention_with_lse,
    merge,
)
from trireme.ops.attention_lse_kernels import fused_block_backward, fused_block_forward
from trireme.parallel.context_parallel import (
    MODES,
    ContextParallel,
    context_attention,
    zigzag_index,
)
from trireme.parallel.ring_attention import Ring, ring_attention

TOL = {"atol": 1e-5, "rtol": 1e-5}


def _inputs(seed: int, seq: int, heads: int = 4, kv_heads: int = 2, d: int = 8):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, seq, d, generator=gen)
    k = torch.randn(2, kv_heads, seq, d, generator=gen)
    v = torch.randn(2, kv_heads, seq, d, generator=gen)
    return q, k, v, torch.randn(2, heads, seq, d, generator=gen)


def _full(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _blocks(seed: int, seq: int) -> list[torch.Tensor]:
    """The key positions cut into 2-4 random non-empty blocks."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = int(torch.randint(2, 5, (1,), generator=gen))
    cuts = torch.randperm(seq - 1, generator=gen)[: num_blocks - 1].sort().values + 1
    return list(torch.tensor_split(torch.randperm(seq, generator=gen), cuts))


def _merged(q, k, v, mask, blocks):
    out = lse = None
    for keys in blocks:
        part = attention_with_lse(q, k[:, :, keys], v[:, :, keys], mask[:, keys])
        out, lse = part if out is None else merge(out, lse, *part)
    return out, lse


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_merged_blocks_equal_full_attention(causal, seed):
    seq = 12
    q, k, v, dout = _inputs(seed, seq)
    mask = torch.ones(seq, seq, dtype=torch.bool)
    mask = mask.tril() if causal else mask
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = _merged(*leaves, mask, _blocks(seed, seq))
    scores = q @ k.repeat_interleave(2, 1).transpose(-2, -1) / 8**0.5
    torch.testing.assert_close(lse, scores.masked_fill(~mask, float("-inf")).logsumexp(-1), **TOL)
    want_leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = _full(*want_leaves, mask)
    torch.testing.assert_close(out, want, **TOL)
    got_grads = torch.autograd.grad(out, leaves, dout)
    want_grads = torch.autograd.grad(want, want_leaves, dout)
    for got, expected in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_rows_without_keys_are_empty_and_merge_neutrally():
    q, k, v, _ = _inputs(0, 4)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[2:, 0] = True  # queries 0, 1 see nothing
    out, lse = attention_with_lse(q, k, v, mask)
    assert (out[:, :, :2] == 0).all() and (lse[:, :, :2] == float("-inf")).all()
    empty_out, empty_lse = attention_with_lse(q, k, v, torch.zeros(4, 4, dtype=torch.bool))
    merged, merged_lse = merge(out, lse, empty_out, empty_lse)
    torch.testing.assert_close(merged, out)
    torch.testing.assert_close(merged_lse, lse)
    leaf = q.clone().requires_grad_()
    grads = torch.autograd.grad(merge(*attention_with_lse(leaf, k, v, mask), empty_out,
                                      empty_lse)[0].sum(), leaf)
    assert torch.isfinite(grads[0]).all()


@pytest.mark.parametrize("seed", range(3))
def test_block_backward_sums_to_full_gradients(seed):
    seq = 10
    q, k, v, dout = _inputs(seed, seq)
    mask = torch.ones(seq, seq, dtype=torch.bool).tril()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = torch.autograd.grad(_full(*leaves, mask), leaves, dout)
    out, lse = attention_with_lse(q, k, v, mask)
    delta = attention_delta(out, dout)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for keys in _blocks(seed, seq):
        part = attention_block_backward(q, k[:, :, keys], v[:, :, keys], mask[:, keys], lse,
                                        delta, dout)
        dq += part[0]
        dk[:, :, keys], dv[:, :, keys] = part[1], part[2]
    for got, expected in zip((dq, dk, dv), want, strict=True):
        torch.testing.assert_close(got, expected, **TOL)


def test_ring_computes_half_of_every_other_ranks_zigzag_block():
    size, seq = 4, 32
    positions = tuple(zigzag_index(seq, size, r) for r in range(size))
    for rank in range(size):
        ring = Ring(None, size, rank, positions)
        for step in range(size):
            block = ring.block(step)
            src = (rank - step) % size
            full = positions[src].unsqueeze(0) <= positions[rank].unsqueeze(1)
            seen = full[block.rows, block.cols]
            assert not full.any() or seen.sum() == full.sum()  # nothing seen is cut
            assert block.mask().equal(seen) and block.pairs() == int(seen.sum())
            assert seen.numel() == (64 if step == 0 else 32)  # [8, 8] own, else half
            # what the flash kernels run: the own block causal, every other one full
            assert block.kind == ("causal" if step == 0 else "full")
            assert seen.all() or seen.equal(seen.tril())


@pytest.mark.parametrize("causal", [True, False])
def test_fused_block_kernel_equals_plain_path(causal):
    """The flash kernel of a block (forward with the LSE; backward from the whole attention's
    final out and lse) equals the plain path, for a block of keys out of a larger set."""
    q, k, v, dout = _inputs(7, 12)
    rows, keys = slice(4, 12), slice(4, 12)  # the block: queries 4..11 over keys 4..11
    mask = torch.ones(12, 12, dtype=torch.bool)
    mask = mask.tril() if causal else mask
    blocks = [torch.arange(0, 4), torch.arange(4, 12)]
    out, lse = _merged(q[:, :, rows], k, v, mask[rows], blocks)  # the final attention
    q_b, k_b, v_b, dout_b = q[:, :, rows], k[:, :, keys], v[:, :, keys], dout[:, :, rows]
    got_out, got_lse, aux = fused_block_forward(q_b, k_b, v_b, causal, "cpu")
    want_out, want_lse = attention_with_lse(q_b, k_b, v_b, mask[rows, keys])
    torch.testing.assert_close(got_out, want_out, **TOL)
    torch.testing.assert_close(got_lse, want_lse.float(), **TOL)
    got = fused_block_backward(dout_b, q_b, k_b, v_b, out, lse.contiguous(), causal, aux, "cpu")
    want = attention_block_backward(q_b, k_b, v_b, mask[rows, keys], lse,
                                    attention_delta(out, dout_b), dout_b)
    for g, w, name in zip(got, want, "qkv", strict=True):
        torch.testing.assert_close(g, w, **TOL, msg=lambda m, n=name: f"d{n}: {m}")


def _check_mode(mode: str, rank: int, world: int, inputs, want, want_grads) -> None:
    q, k, v, dout = inputs
    index = zigzag_index(q.shape[2], world, rank)
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = context_attention(*local, ContextParallel(dist.group.WORLD, world, rank, mode))
    torch.testing.assert_close(out, want[:, :, index], **TOL, msg=lambda m: f"{mode}: {m}")
    grads = torch.autograd.grad(out, local, dout[:, :, index])
    for got, expected, name in zip(grads, want_grads, "qkv", strict=True):
        torch.testing.assert_close(got, expected[:, :, index], **TOL,
                                   msg=lambda m, name=name: f"{mode} d{name}: {m}")


def _modes(rank: int, world: int) -> None:
    """Every mode: this rank's zigzag slice of the output and of the q, k, v gradients equal
    full causal attention's."""
    seq = 8 * world
    inputs = _inputs(0, seq, heads=2 * world, kv_heads=world)  # a2a: C divides the kv heads
    leaves = [t.clone().requires_grad_() for t in inputs[:3]]
    want = _full(*leaves, torch.ones(seq, seq, dtype=torch.bool).tril())
    want_grads = torch.autograd.grad(want, leaves, inputs[3])
    for mode in MODES:
        _check_mode(mode, rank, world, inputs, want, want_grads)
    _check_plain_ring(rank, world, inputs, want, want_grads)


def _check_plain_ring(rank: int, world: int, inputs, want, want_grads) -> None:
    """The ring on the plain fp32 path (no flash kernel) agrees too."""
    q, k, v, dout = inputs
    index = zigzag_index(q.shape[2], world, rank)
    positions = tuple(zigzag_index(q.shape[2], world, r) for r in range(world))
    local = [t[:, :, index].clone().requires_grad_() for t in (q, k, v)]
    out = ring_attention(*local, Ring(dist.group.WORLD, world, rank, positions, kernel="plain"))
    torch.testing.assert_close(out, want[:, :, index], **TOL)
    grads = torch.autograd.grad(out, local, dout[:, :, index])
    for got, expected in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, expected[:, :, index], **TOL)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_context_parallel_modes_equal_full_attention(tmp_path, world):
    run_ranks(_modes, world, tmp_path)
