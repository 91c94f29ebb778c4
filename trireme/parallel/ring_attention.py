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
costs half. Those half blocks are rectangles every query of which sees every key ("full"), and a
rank's own block is the lower triangle ("causal": its positions rise in local order), so each
runs on a flash kernel that returns the LSE (trireme/ops/attention_lse_kernels.py) where one
exists for the device and dtype; other masks, and `Ring(fused=False)`, take the plain fp32 path of
attention_lse (the reference the kernels are tested against).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist
from torch import Tensor

from trireme.ops.attention_lse import (
    attention_block_backward,
    attention_delta,
    attention_with_lse,
    merge,
)
from trireme.ops.attention_lse_kernels import (
    KINDS,
    choose_kernel,
    fused_block_backward,
    fused_block_forward,
)
from trireme.parallel.p2p import start_exchange


@dataclass(frozen=True, eq=False)
class Block:
    """The part of a held K/V block that this rank's queries see: query `rows`, key `cols`, and
    the global positions of those queries and keys (CPU), which say who sees whom: its `kind` is
    "full" (every query sees every key), "causal" (the same positions, rising: the lower
    triangle), "mask" (anything else) or "empty". Only the plain path builds the mask itself
    ([rows, cols]: a gigabyte at 32k tokens, which the kernels never need)."""

    rows: slice
    cols: slice
    query_positions: Tensor
    key_positions: Tensor
    kind: str

    def mask(self, device: torch.device | None = None) -> Tensor:
        """[rows, cols] bool, True where the query may see the key."""
        mask = self.key_positions.unsqueeze(0) <= self.query_positions.unsqueeze(1)
        return mask if device is None else mask.to(device)

    def pairs(self) -> int:
        """How many (query, key) pairs are seen: the block's attention work."""
        n_q, n_k = len(self.query_positions), len(self.key_positions)
        if self.kind in ("full", "empty"):
            return n_q * n_k
        return n_q * (n_q + 1) // 2 if self.kind == "causal" else int(self.mask().sum())


def _kind(queries: Tensor, keys: Tensor) -> str:
    if len(queries) == 0 or len(keys) == 0:
        return "empty"
    if keys.max() <= queries.min():
        return "full"
    rising = len(queries) < 2 or bool((queries[1:] > queries[:-1]).all())
    return "causal" if rising and queries.equal(keys) else "mask"


@dataclass(frozen=True, eq=False)
class Ring:
    """The ring's group, its size, this rank, and the global positions of every rank's tokens
    (positions[r] [s] on the CPU: rank r's tokens in its local order), which define the causal
    mask; `kernel`: what runs full and causal blocks (trireme.ops.attention_lse_kernels: "auto",
    "cudnn", "flash", or "plain", the reference path every other mask takes too)."""

    group: dist.ProcessGroup
    size: int
    rank: int
    positions: tuple[Tensor, ...]
    kernel: str = "auto"

    def block(self, step: int) -> Block:
        """The block held at `step` (rank r - step's): the query rows that see some key of it,
        the key columns some query sees, and where each sees which (causal by global position).
        Everything outside is masked out wholly and skipped: under zigzag half the keys (an
        earlier rank's block) or half the queries (a later rank's) of every block but this
        rank's own."""
        queries, keys = self.positions[self.rank], self.positions[(self.rank - step) % self.size]
        rows, cols = _span(queries >= keys.min()), _span(keys <= queries.max())
        return Block(rows, cols, queries[rows], keys[cols], _kind(queries[rows], keys[cols]))

    def kernel_for(self, block: Block, q: Tensor) -> str:
        """The kernel that runs `block` of queries q: "plain" unless its mask is one a kernel
        knows."""
        return choose_kernel(self.kernel if block.kind in KINDS else "plain", q)

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


def _attend(q: Tensor, kv: Tensor, block: Block, ring: Ring) -> tuple[Tensor, Tensor, tuple]:
    """(out, lse, the kernel's aux) of the block's rows of q over its columns of kv."""
    q, k, v = q[:, :, block.rows], kv[0, :, :, block.cols], kv[1, :, :, block.cols]
    kernel = ring.kernel_for(block, q)
    if kernel != "plain":
        return fused_block_forward(q, k, v, block.kind == "causal", kernel)
    return *attention_with_lse(q, k, v, block.mask(q.device)), ()


def _ring_forward(q: Tensor, k: Tensor, v: Tensor, ring: Ring
                  ) -> tuple[Tensor, Tensor, dict[str, tuple]]:
    """(out in q's dtype, lse fp32, each block kind's kernel aux for the backward)."""
    kv = torch.stack([k, v])  # [2, b, H_kv, s, d]: one message a step
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)  # attention over no key
    lse = torch.full(q.shape[:3], float("-inf"), device=q.device)
    aux: dict[str, tuple] = {}  # a kernel's aux for the backward, by block kind
    for step in range(ring.size):
        transfer = ring.pass_on(kv) if step + 1 < ring.size else None
        block = ring.block(step)
        if block.kind != "empty":
            part_out, part_lse, aux[block.kind] = _attend(q, kv, block, ring)
            rows = block.rows
            out[:, :, rows], lse[:, :, rows] = merge(out[:, :, rows], lse[:, :, rows],
                                                     part_out, part_lse)
        if transfer is not None:
            kv = _arrived(transfer)
    return out.to(q.dtype), lse, aux


@dataclass(frozen=True, eq=False)
class _Final:
    """What every block's backward reads: the final out and lse, dout, and (for the plain path;
    a kernel computes its own) D = rowsum(dO * O)."""

    out: Tensor
    lse: Tensor
    dout: Tensor
    aux: dict[str, tuple]

    @cached_property
    def delta(self) -> Tensor:
        return attention_delta(self.out, self.dout)


def _block_gradients(q: Tensor, kv: Tensor, final: _Final, dq: Tensor, block: Block,
                     ring: Ring) -> Tensor:
    """Adds the block's share of dq into `dq`; -> the block's [2, b, H_kv, s, d] dK/dV share."""
    rows, cols = block.rows, block.cols
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if block.kind == "empty":
        return dkv
    q_rows, k, v = q[:, :, rows], kv[0, :, :, cols], kv[1, :, :, cols]
    kernel = ring.kernel_for(block, q_rows)
    if kernel != "plain":
        dq_part, dkv[0, :, :, cols], dkv[1, :, :, cols] = fused_block_backward(
            final.dout[:, :, rows], q_rows, k, v, final.out[:, :, rows],
            final.lse[:, :, rows].contiguous(), block.kind == "causal", final.aux[block.kind],
            kernel)
    else:
        dq_part, dkv[0, :, :, cols], dkv[1, :, :, cols] = attention_block_backward(
            q_rows, k, v, block.mask(q.device), final.lse[:, :, rows], final.delta[:, :, rows],
            final.dout[:, :, rows])
    dq[:, :, rows] += dq_part
    return dkv


def _ring_backward(q: Tensor, k: Tensor, v: Tensor, final: _Final, ring: Ring
                   ) -> tuple[Tensor, Tensor, Tensor]:
    kv = torch.stack([k, v])
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    carried = None  # the accumulator of the block now held, on its way from the previous rank
    for step in range(ring.size):
        transfer = ring.pass_on(kv) if step + 1 < ring.size else None
        dkv = _block_gradients(q, kv, final, dq, ring.block(step), ring)
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
        out, lse, aux = _ring_forward(q, k, v, ring)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.aux = ring, aux
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        final = _Final(out, lse, dout, ctx.aux)
        dq, dk, dv = _ring_backward(q, k, v, final, ctx.ring)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, ring: Ring) -> Tensor:
    """Attention of this rank's queries q [b, H, s, d] over every rank's keys and values
    (k, v [b, H_kv, s, d] here), causal by the ring's positions; -> [b, H, s, d]."""
    return _RingAttention.apply(q, k, v, ring)
