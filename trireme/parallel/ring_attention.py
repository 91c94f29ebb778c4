"""Ring attention: each rank keeps its queries while the key/value blocks travel around the ring.

Rank r of C starts with its own K/V block. At every step it passes the block it holds to rank
r + 1 and receives the next from rank r - 1 (point-to-point, started before the step's compute so
the transfer overlaps it), attends its queries to the block it holds under the causal mask built
from the tokens' global positions, and merges the result into its running (out, lse) exactly
(trireme/ops/attention_lse.py). After C steps it has seen every block once. Under GQA only the
key/value heads travel.

The backward (a custom autograd function, the flash / ring backward) sends the K/V blocks around
again, each with a gradient accumulator dK/dV that travels with it: every rank adds its queries'
share of the block's gradient (recomputed from the saved final lse, nothing of the forward's
probabilities is kept), and after C steps the accumulator, complete, takes one last hop home.
dQ stays local. The accumulators travel in fp32.

Only the part of a block that the causal mask connects is computed: under zigzag an earlier
rank's block is seen by all of this rank's queries but only through its first chunk, a later
rank's by all its keys but only from this rank's last chunk, so every block but the rank's own
costs half. The attention runs on the plain fp32 path of attention_lse (exact; no fused kernel
that returns the LSE is wired in yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from trireme.ops.attention_lse import (
    attention_block_backward,
    attention_delta,
    attention_with_lse,
    merge,
)
from trireme.parallel.p2p import start_exchange


@dataclass(frozen=True, eq=False)
class Ring:
    """The ring's group, its size, this rank, and the global positions of every rank's tokens
    (positions[r] [s] on the CPU: rank r's tokens in its local order), which define the causal
    mask."""

    group: dist.ProcessGroup
    size: int
    rank: int
    positions: tuple[Tensor, ...]

    def block(self, step: int, device: torch.device) -> tuple[slice, slice, Tensor]:
        """(rows, cols, mask [rows, cols] on `device`) of the block held at `step` (rank
        r - step's): the query rows that see some key of it, the key columns some query sees,
        and where each sees which (causal by global position). Everything outside is masked out
        wholly and skipped: under zigzag half the keys (an earlier rank's block) or half the
        queries (a later rank's) of every block but this rank's own."""
        queries, keys = self.positions[self.rank], self.positions[(self.rank - step) % self.size]
        rows, cols = _span(queries >= keys.min()), _span(keys <= queries.max())
        mask = keys[cols].unsqueeze(0) <= queries[rows].unsqueeze(1)
        return rows, cols, mask.to(device)

    def pass_on(self, block: Tensor) -> tuple[Tensor, list[dist.Work]]:
        """Start sending `block` to the next rank and receiving the previous rank's; -> (the
        receive buffer, the works to wait on before reading it)."""
        arriving = torch.empty_like(block)
        works = start_exchange([("send", block, (self.rank + 1) % self.size),
                                ("recv", arriving, (self.rank - 1) % self.size)], self.group)
        return arriving, works


def _span(flags: Tensor) -> slice:
    """The slice from the first to the last True of `flags` (empty when none is)."""
    hits = flags.nonzero().flatten().tolist()
    return slice(hits[0], hits[-1] + 1) if hits else slice(0, 0)


def _arrived(transfer: tuple[Tensor, list[dist.Work]]) -> Tensor:
    tensor, works = transfer
    for work in works:
        work.wait()
    return tensor


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> tuple[Tensor, Tensor]:
    kv = torch.stack([k, v])  # [2, b, H_kv, s, d]: one message a step
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # attention over no key
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    for step in range(ring.size):
        transfer = ring.pass_on(kv) if step + 1 < ring.size else None
        rows, cols, mask = ring.block(step, q.device)
        if mask.numel():
            part = attention_with_lse(q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], mask)
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows], *part)
        if transfer is not None:
            kv = _arrived(transfer)
    return out.to(q.dtype), lse


def _block_gradients(q: Tensor, kv: Tensor, lse: Tensor, delta: Tensor, dout: Tensor,
                     dq: Tensor, block: tuple[slice, slice, Tensor]) -> Tensor:
    """Adds the block's share of dq into `dq`; -> the block's [2, b, H_kv, s, d] dK/dV share."""
    rows, cols, mask = block
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if mask.numel():
        dq_part, dkv[0, :, :, cols], dkv[1, :, :, cols] = attention_block_backward(
            q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols], mask, lse[:, :, rows],
            delta[:, :, rows], dout[:, :, rows])
        dq[:, :, rows] += dq_part
    return dkv


def _ring_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                   ring: Ring) -> tuple[Tensor, Tensor, Tensor]:
    delta = attention_delta(out, dout)
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    carried = None  # the accumulator of the block now held, on its way from the previous rank
    for step in range(ring.size):
        transfer = ring.pass_on(kv) if step + 1 < ring.size else None
        dkv = _block_gradients(q, kv, lse, delta, dout, dq, ring.block(step, q.device))
        if carried is not None:
            dkv += _arrived(carried)
        carried = ring.pass_on(dkv) if ring.size > 1 else (dkv, [])
        if transfer is not None:
            kv = _arrived(transfer)
    dkv = _arrived(carried)  # after its last hop: this rank's own block, every rank's share in
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
        out, lse = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(q, k, v, out, lse, dout, ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
    """Attention of this rank's queries q [b, H, s, d] over every rank's keys and values
    (k, v [b, H_kv, s, d] here), causal by the ring's positions; -> [b, H, s, d]."""
    return _RingAttention.apply(q, k, v, ring)
