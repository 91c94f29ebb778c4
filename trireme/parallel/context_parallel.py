"""Context parallelism: the sequence of every layer cut over the C ranks of the context group.

Causal attention does more work late in the sequence than early, so a plain cut into C runs would
give the last rank the most work. The sequence is cut into 2C chunks instead and rank r holds
chunks r and 2C - 1 - r ("zigzag"): every rank gets one early and one late chunk, the same work.
`zigzag_index(seq, C, r)` lists the positions rank r holds, in its local order; tokens, labels,
the loss mask and the positions (RoPE) are all cut with it (`split_sequence`), so a token keeps
its global position.

Attention then needs the other ranks' keys and values. The ways (`context_attention`):

- allgather: gather every rank's K and V (the gradient: a reduce-scatter back), and attend the
  local queries to all of them under a mask built from the global positions. Simple, memory
  O(sequence) per rank; the reference the others are tested against.
- a2a (Ulysses): an all-to-all turns [local tokens, all heads] into [all tokens, H / C heads],
  each rank runs ordinary causal attention over the whole sequence for its heads (tokens put back
  in position order first), and a second all-to-all turns it back. C must divide the query and
  the key/value heads of this rank.
- ring: the K/V blocks (key/value heads only) pass from rank to rank while each rank attends its
  queries to the block it holds, merging the partial results by their log-sum-exp; memory O(s)
  per rank, communication overlapped with the blocks' compute (trireme/parallel/ring_attention.py).

Each function takes the group, its size and this rank explicitly (`ContextParallel`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from trireme.data.batch import Batch
from trireme.parallel.comm import _gather_dim1, gather_sequence
from trireme.parallel.ring_attention import Ring, ring_attention

MODES = ("allgather", "a2a", "ring")


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in the context group, and how attention crosses it."""

    group: dist.ProcessGroup
    size: int
    rank: int
    mode: str = "allgather"


def zigzag_index(seq: int, size: int, rank: int, device=None) -> Tensor:
    """The global positions rank `rank` of `size` holds: chunks rank and 2 size - 1 - rank of
    2 size equal chunks, in that order. `seq` must be divisible by 2 size."""
    if seq % (2 * size):
        raise ValueError(f"a sequence of {seq} tokens does not cut into {2 * size} equal chunks")
    chunk = seq // (2 * size)
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    last = torch.arange((2 * size - 1 - rank) * chunk, (2 * size - rank) * chunk, device=device)
    return torch.cat([first, last])


def all_positions(seq: int, size: int, device=None) -> Tensor:
    """The global positions of the tokens gathered in rank order: [seq]."""
    return torch.cat([zigzag_index(seq, size, r, device) for r in range(size)])


def split_sequence(x: Tensor, cp: ContextParallel, dim: int = 1) -> Tensor:
    """This rank's tokens of `x` (the whole sequence along `dim`)."""
    index = zigzag_index(x.shape[dim], cp.size, cp.rank, x.device)
    return x.index_select(dim, index)


def split_batch(batch: Batch, cp: ContextParallel) -> Batch:
    """This rank's share of a micro batch: tokens, labels and the loss mask cut by
    `zigzag_index`, with the global positions as position_ids (RoPE, learned positions)."""
    b, seq = batch.tokens.shape
    index = zigzag_index(seq, cp.size, cp.rank, batch.tokens.device)

    def cut(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.index_select(1, index)

    positions = batch.position_ids if batch.position_ids is not None else index.expand(b, -1)
    return dataclasses.replace(
        batch, tokens=cut(batch.tokens), labels=cut(batch.labels), loss_mask=cut(batch.loss_mask),
        position_ids=cut(positions) if batch.position_ids is not None else positions.contiguous(),
        document_ids=cut(batch.document_ids), context_split=True)


def context_loss_scale(labels: Tensor, loss_mask: Tensor | None, cp: ContextParallel) -> Tensor:
    """C x (this rank's counted tokens) / (the whole sequence's): times this rank's mean loss,
    the mean over the context ranks is the whole sequence's mean loss (-100 labels do not
    count)."""
    counted = labels != -100
    if loss_mask is not None:
        counted = counted & (loss_mask != 0)
    count = counted.sum().float()
    total = count.clone()
    dist.all_reduce(total, group=cp.group)
    return cp.size * count / total.clamp(min=1.0)


def context_attention(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel,
                      document_ids: Tensor | None = None) -> Tensor:
    """Causal attention of this rank's queries q [b, H, s, d] over the whole sequence, whose keys
    and values k, v [b, H_kv, s, d] are cut over the context group like q; -> [b, H, s, d].
    `document_ids` [b, s] (this rank's share; packed documents): tokens see only their own
    document (the allgather mode only)."""
    if cp.mode == "allgather":
        return _allgather_attention(q, k, v, cp, document_ids)
    if document_ids is not None:
        raise ValueError("packed documents under context parallelism need "
                         "parallel.context_mode = 'allgather'")
    if cp.mode == "a2a":
        return _a2a_attention(q, k, v, cp)
    if cp.mode == "ring":
        seq = q.shape[2] * cp.size
        positions = tuple(zigzag_index(seq, cp.size, r) for r in range(cp.size))  # CPU
        return ring_attention(q, k, v, Ring(cp.group, cp.size, cp.rank, positions))
    raise ValueError(f"context-parallel mode {cp.mode!r} is not one of {MODES}")


def _gather_tokens(x: Tensor, cp: ContextParallel) -> Tensor:
    """[b, H, s, d] per rank -> [b, H, C s, d] in rank order (reduce-scatter backward)."""
    b, h, s, d = x.shape
    flat = x.transpose(1, 2).reshape(b, s, h * d)  # the sequence as dim 1
    full = gather_sequence(flat, cp.group, cp.size)  # [b, C s, h d]
    return full.view(b, cp.size * s, h, d).transpose(1, 2)


def _allgather_attention(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel,
                         document_ids: Tensor | None) -> Tensor:
    seq = q.shape[2] * cp.size
    k_all, v_all = _gather_tokens(k, cp), _gather_tokens(v, cp)
    q_pos = zigzag_index(seq, cp.size, cp.rank, q.device)  # [s]
    k_pos = all_positions(seq, cp.size, q.device)  # [C s]
    mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)  # [s, C s]
    if document_ids is not None:  # [b, s] -> same document as the key: [b, 1, s, C s]
        docs_all = _gather_dim1(document_ids, cp.group, cp.size)  # [b, C s] in rank order
        same = document_ids.unsqueeze(2) == docs_all.unsqueeze(1)
        mask = (mask & same).unsqueeze(1)
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask,
                                          enable_gqa=q.shape[1] != k.shape[1])


class _SeqToHeads(torch.autograd.Function):
    """[b, H, s, d] (local tokens, all heads) -> [b, H / C, C s, d] (all tokens in rank order,
    this rank's heads); the backward is the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group, size: int) -> Tensor:
        ctx.group, ctx.size = group, size
        return _seq_to_heads(x, group, size)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None]:
        return _heads_to_seq(dy, ctx.group, ctx.size), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group, size: int) -> Tensor:
        ctx.group, ctx.size = group, size
        return _heads_to_seq(x, group, size)

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, None, None]:
        return _seq_to_heads(dy, ctx.group, ctx.size), None, None


def _seq_to_heads(x: Tensor, group, size: int) -> Tensor:
    b, h, s, d = x.shape
    send = x.reshape(b, size, h // size, s, d).transpose(0, 1).contiguous()  # [C, b, h/C, s, d]
    recv = torch.empty_like(send)  # [C (sender), b, h/C, s, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * s, d)


def _heads_to_seq(x: Tensor, group, size: int) -> Tensor:
    b, hc, seq, d = x.shape
    s = seq // size
    send = x.reshape(b, hc, size, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [C, b, h/C, s, d]
    recv = torch.empty_like(send)  # [C (head group), b, h/C, s, d]
    dist.all_to_all_single(recv, send, group=group)
    return recv.transpose(0, 1).reshape(b, size * hc, s, d)


def _a2a_attention(q: Tensor, k: Tensor, v: Tensor, cp: ContextParallel) -> Tensor:
    if q.shape[1] % cp.size or k.shape[1] % cp.size:
        raise ValueError(
            f"parallel.context_mode = 'a2a' needs parallel.context = {cp.size} to divide the "
            f"{q.shape[1]} query and {k.shape[1]} key/value heads of a rank; use 'allgather'")
    seq = q.shape[2] * cp.size
    order = torch.argsort(all_positions(seq, cp.size, q.device))  # rank order -> position order
    q, k, v = (_SeqToHeads.apply(t, cp.group, cp.size)[:, :, order] for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                       enable_gqa=q.shape[1] != k.shape[1])
    y = y[:, :, torch.argsort(order)]  # back to rank order
    return _HeadsToSeq.apply(y.contiguous(), cp.group, cp.size)
