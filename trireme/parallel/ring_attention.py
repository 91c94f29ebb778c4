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

The attention runs on the plain fp32 path of attention_lse (exact, not yet a fused kernel), and
every block costs a full [s, s] score matrix even where the zigzag mask hides half of it.
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
    (positions[r] [s]: rank r's tokens in its local order), which define the causal mask."""

    group: dist.ProcessGroup
    size: int
    rank: int
    positions: tuple[Tensor, ...]

    def mask(self, step: int) -> Tensor:
        """[s_q, s_k] True where this rank's query may see a key of the block held at `step`
        (the block of rank r - step)."""
        keys = self.positions[(self.rank - step) % self.size]
        return keys.unsqueeze(0) <= self.positions[self.rank].unsqueeze(1)

    def pass_on(self, block: Tensor) -> tuple[Tensor, list[dist.Work]]:
        """Start sending `block` to the next rank and receiving the previous rank's; -> (the
        receive buffer, the works to wait on before reading it)."""
        arriving = torch.empty_like(block)
        works = start_exchange([("send", block, (self.rank + 1) % self.size),
                                ("recv", arriving, (self.rank - 1) % self.size)], self.group)
        return arriving, works


def _arrived(transfer: tuple[Tensor, list[dist.Work]]) -> Tensor:
    tensor, works = transfer
    for work in works:
        work.wait()
    return tensor


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> tuple[Tensor, Tensor]:
    kv = torch.stack([k, v])  # [2, b, H_kv, s, d]: one message a step
    out = lse = None
    for step in range(ring.size):
        transfer = ring.pass_on(kv) if step + 1 < ring.size else None
        part = attention_with_lse(q, kv[0], kv[1], ring.mask(step))
        out, lse = part if out is None else merge(out, lse, *part)
        if transfer is not None:
            kv = _arrived(transfer)
    return out.to(q.dtype), lse


def _ring_backward(q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, dout: Tensor,
                   ring: Ring) -> tuple[Tensor, Tensor, Tensor]:
    delta = attention_delta(out, dout)
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    carried = None  # the accumulator of the block now held, on its way from the previous rank
    for step in range(ring.size):
        transfer = ring.pass_on(kv) if step + 1 < ring.size else None
        dq_part, dk, dv = attention_block_backward(q, kv[0], kv[1], ring.mask(step), lse, delta,
                                                   dout)
        dq += dq_part
        dkv = torch.stack([dk, dv])
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
